"""What an operator and a user read of the server beside its answers: the log format
(`logs`), the SDK's telemetry on disk (`telemetry_log`), a session's requests as a Perfetto
trace (`trace_builder`) and those traces' builds, files and signed grants (`trace_exports`).
`/metrics` and the dashboard are routes, in api/.

May import store/ and the ground floor.
"""
