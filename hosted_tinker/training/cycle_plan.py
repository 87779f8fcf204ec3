"""A cycle's plan and the requests in it: what the scheduler hands the device loop, and what the
worker, the accounting and the request-parts bookkeeping read of a cycle (they need no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..requests.kinds import FBWork, Payload, RequestKind

COMPUTE = frozenset({RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD})


@dataclass
class Request:
    request_id: str
    kind: RequestKind
    model_id: str
    seq_id: int
    payload: Payload = None  # the kind's payload (request_types.py)
    tokens: int = 0  # compute requests: tokens to run, for the cycle's token budget
    arrived_at: float = 0.0  # stamped by the scheduler's clock on submit
    # A compute request split across cycles: the (payload, tokens) of the parts after this one.
    more: list[tuple[FBWork, int]] = field(default_factory=list)
    final: bool = True  # False for a planned part with more to come: answered after its last part
    part: int = 0  # a request in parts: which part this is (0 the first)
    owner: str = ""  # the API key's owner (a key whose request failed a pass runs apart: isolation.py)

    @property
    def in_parts(self) -> bool:
        """A request (or a planned part of one) that runs in parts over several cycles."""
        return bool(self.more) or self.part > 0 or not self.final

    @property
    def first_part(self) -> bool:
        return self.part == 0 and not self.final


@dataclass
class CyclePlan:
    compute: list[Request] = field(default_factory=list)
    optim: list[Request] = field(default_factory=list)
    tail: list[Request] = field(default_factory=list)  # per-model order preserved
    orphaned: list[Request] = field(default_factory=list)  # their model was unloaded: they fail

    def __bool__(self) -> bool:
        return bool(self.compute or self.optim or self.tail or self.orphaned)

    @property
    def models(self) -> set[str]:
        """The models this cycle runs work for."""
        return {r.model_id for r in self.compute + self.optim + self.tail}

    @property
    def requests(self) -> list[Request]:
        """Every request the cycle runs (a part of a split request included)."""
        return self.compute + self.optim + self.tail + self.orphaned

    @property
    def finishing(self) -> list[Request]:
        """The requests the cycle must answer: all but the parts of split requests with more to come."""
        return [r for r in self.requests if r.final]
