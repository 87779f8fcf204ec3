"""Accounts: who a caller is, what they may touch, and what they used.

- `auth`, `tokens`, `revoked_keys`: API keys and their owners (the keys file read again when it
  changes), the JWTs the SDK exchanges them for, keys a user logged out;
- `access`: may this key use this object (asked on every use), the admin role;
- `accounting` (the `Server`'s counting observer), `usage_meter`, `audit_log`, `request_timings`,
  `accounting_writer`: usage, audit entries and session timings counted beside the work, written
  in batches; `rate_card`: the operator's prices.

May import: training/ (a cycle's plan), sampling/ (its jobs), checkpoints/, requests/, store/ and
the ground floor. Never HTTP (that is api/'s) and never the device side.
"""
