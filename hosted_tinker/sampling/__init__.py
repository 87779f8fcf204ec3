"""Sampling: jobs (`jobs`), the backend seam (`backend`, chosen in `backends`), the built-in engine
(`engine`, `admission`, `kv_cache`, `step`, `rows`, `pick`) and the vLLM sidecar
(`vllm_server_backend` and the `vllm_*` modules), which know nothing of each other; snapshots
for sampling sessions and recorded samples for `stable_reinforce`.

May import checkpoints/, runtime/, config/, requests/, wire/, models/, store/ and the ground floor.
"""
