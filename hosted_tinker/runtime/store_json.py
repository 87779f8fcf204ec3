"""`StoreJson`: a dataclass the worker pool's ranks hand each other through the rendezvous store, as JSON
(rank 0's `PoolSettings`, each rank's advertised address)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Self


class StoreJson:
    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]  # a subclass is a dataclass

    @classmethod
    def from_json(cls, text: bytes | str) -> Self:
        return cls(**json.loads(text))
