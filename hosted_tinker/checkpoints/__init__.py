"""Checkpoints: everything about a saved adapter, from its files to its address.

- `paths`: `TinkerPath`, the `tinker://<run>/<kind>/<name>` address, and the kinds it may name;
- `format`: the files of one checkpoint (PEFT adapter, optimizer state, manifest), written
  atomically and read as untrusted input;
- `catalog`: a checkpoint's record and folder, created, found and deleted together; TTL expiry;
- `recovery`: the start-up repair after a kill -9 at any point of a write;
- `transfer`: archives out and in, signed download URLs, imports of adapters made elsewhere.

Also `adapter_io` (a model's adapter saved and restored through its runtime), `merge`, `encryption`,
`untrusted`, and `export` (the CLI's export and import). May import runtime/ (the `ModelRuntime`
seam), models/, store/ and the ground floor.
"""
