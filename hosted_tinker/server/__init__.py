"""The server, built: `core.Server` owns the shared parts (data-dir lock, store, futures,
checkpoints, keys, accounting) and the registry of served models; `served_models` declares each
model's tokenizer, runtime, scheduler, worker, sampler and device loop in one place; `startup`
checks every setting before anything slow; `retention` keeps the data dir bounded.

May import accounts/, training/, sampling/ and everything below. Never HTTP.
"""
