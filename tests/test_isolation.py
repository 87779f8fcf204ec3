"""Unit tests of `run_isolating` and `Quarantine` (hosted_tinker/training/isolation.py): which passes are
rerun after a fused pass raises, with plain values for requests and a pass that raises where
it holds a poisoned one (the real passes: tests/test_failure_isolation.py)."""

from __future__ import annotations

from hosted_tinker.errors import MachineFault
from hosted_tinker.training.isolation import Quarantine, run_isolating


class Passes:
    """A pass over (model, name) requests: raises where it holds a name in `poison`; keeps every
    pass it was given."""

    def __init__(self, *poison: str, fault: type[Exception] = ValueError):
        self.poison, self.fault, self.runs = set(poison), fault, []

    def __call__(self, works):
        self.runs.append([name for _, name in works])
        bad = [name for _, name in works if name in self.poison]
        if bad:
            raise self.fault(f"cannot take {bad}")
        return [f"out-{name}" for _, name in works]


WORKS = [("m1", "a"), ("m2", "b"), ("m2", "c"), ("m3", "d"), ("m4", "e")]


def isolate(passes: Passes, works=WORKS):
    return run_isolating(passes, works, [model for model, _ in works])


def test_a_pass_that_does_not_raise_runs_once():
    passes = Passes()
    got = isolate(passes)
    assert got.outcomes == ["out-a", "out-b", "out-c", "out-d", "out-e"] and got.errors == [None] * 5
    assert (got.failed_passes, got.reruns, passes.runs) == (0, 0, [["a", "b", "c", "d", "e"]])


def test_the_request_that_raises_fails_alone_and_a_models_requests_stay_together():
    passes = Passes("d")
    got = isolate(passes)
    assert got.outcomes == ["out-a", "out-b", "out-c", None, "out-e"]
    assert isinstance(got.errors[3], ValueError) and got.culprits == [3]
    # halves of whole models (m2's two requests together), then of the failing half
    assert passes.runs == [["a", "b", "c", "d", "e"], ["a", "b", "c"], ["d", "e"], ["d"], ["e"]]
    assert (got.failed_passes, got.reruns) == (3, 4)


def test_within_the_last_model_its_requests_split_in_order():
    passes = Passes("c")
    got = isolate(passes, [("m2", "b"), ("m2", "c"), ("m2", "x")])
    assert got.outcomes == ["out-b", None, "out-x"] and got.culprits == [1]
    assert passes.runs == [["b", "c", "x"], ["b"], ["c", "x"], ["c"], ["x"]]


def test_a_fault_no_request_caused_is_not_rerun():
    passes = Passes("a", fault=MachineFault)
    got = isolate(passes)
    assert passes.runs == [["a", "b", "c", "d", "e"]] and got.culprits == []
    assert all(isinstance(e, MachineFault) for e in got.errors) and got.outcomes == [None] * 5


def test_a_transient_fault_reruns_everyone_with_their_results():
    class Once(Passes):
        def __call__(self, works):
            if not self.runs:
                self.runs.append(None)
                raise RuntimeError("out of memory, once")
            return super().__call__(works)

    got = isolate(Once())
    assert got.outcomes == ["out-a", "out-b", "out-c", "out-d", "out-e"] and got.culprits == []


def test_a_key_is_held_apart_until_its_clean_passes_are_done():
    q = Quarantine(clean_passes=2)
    q.convict("mallory")
    assert "mallory" in q and len(q) == 1
    q.passed("mallory")
    q.convict("mallory")  # failed again: the count starts over
    q.passed("mallory")
    assert "mallory" in q
    q.passed("mallory")
    assert "mallory" not in q and len(q) == 0
