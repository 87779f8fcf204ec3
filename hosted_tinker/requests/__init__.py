"""What the services hand the device, and how the answer comes back.

- `kinds`: each request kind (`RequestKind`), its payload and its result type, with the JSON or
  protobuf its future answers;
- `futures`: the long-polled futures, written to SQLite before anyone sees them.

May import wire/, models/ (an image's pixels), store/ and the ground floor.
"""
