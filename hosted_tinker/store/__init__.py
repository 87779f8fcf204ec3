"""The data dir's durable state: SQLite in WAL mode (`database`: reads on a connection per
thread, writes group-committed on one writer, a time budget for the queries a user shapes), its
tables (`tables.Store` holds one small class per table group: `sessions`, `runs`, `futures`,
`checkpoints`, `sampling_sessions`, `samples`, `losses`; `accounting` for usage, audit and
timings; `search`; `retention`), the frozen records they hand out (`records`), and the data
dir's other parts: one server per dir (`data_dir_lock`), its size by kind (`data_dir_usage`),
its secrets (`secret_files`).

May import only the ground floor (errors, faults).
"""
