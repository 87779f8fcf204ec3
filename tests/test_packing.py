"""The packing plan (runtime/packing.py), without a model: which rows go to which micro-batch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hosted_tinker.runtime.packing import RequestShape, bucket_width, pack, shared_shapes


def always(width, rows):
    return True


def never(width, rows):
    return False


def rows_of(plan, requests, model_id):
    """A model's micro-batch pieces as (grad, width, its rows in order), in plan order."""
    out = []
    for mb in plan.micro_batches:
        mine = tuple(r for r in mb.rows if requests[r[0]].model_id == model_id)
        if mine:
            out.append((mb.grad, mb.width, mine))
    return out


def test_bucket_widths_grow_by_at_most_half():
    widths = [bucket_width(n) for n in range(1, 2000)]
    assert widths[:16] == [16] * 16 and bucket_width(17) == 24 and bucket_width(25) == 32
    assert all(w >= n and (w <= 16 or w <= 1.5 * n) for n, w in zip(range(1, 2000), widths))


def test_a_model_runs_the_same_pieces_alone_and_with_others():
    alone = [RequestShape("a", (100, 30, 100, 100, 5))]
    crowd = [RequestShape("b", (100,) * 7), alone[0], RequestShape("c", (30, 30)), RequestShape("a", (100,), forward_only=True)]
    for may_mix in (always, never):
        solo = pack(alone, 256, may_mix=may_mix)
        shared = pack(crowd, 256, may_mix=may_mix)
        # request 0 alone is request 1 in the crowd: same datums, same pieces, same order
        mine = [(g, w, tuple((0, d) for _, d in rows)) for g, w, rows in rows_of(shared, crowd, "a") if g]
        assert rows_of(solo, alone, "a") == mine


def test_pieces_share_a_micro_batch_only_where_allowed_and_within_the_budget():
    reqs = [RequestShape(m, (20,) * 3) for m in "abcd"]  # width 24: 10 rows per 256-token micro-batch
    asked = []
    plan = pack(reqs, 256, may_mix=lambda w, r: asked.append((w, r)) or True)
    assert [len(mb.rows) for mb in plan.micro_batches] == [9, 3]
    assert all(mb.padded_tokens <= 256 for mb in plan.micro_batches)
    assert set(asked) == shared_shapes(reqs, 256) == {(24, 9)}  # the lone last piece is not asked about
    assert [s[0] for s in plan.micro_batches[0].segments] == ["a", "b", "c"]
    assert plan.micro_batches[1].segments == (("d", 0, 3),)
    apart = pack(reqs, 256, may_mix=never)
    assert [mb.segments for mb in apart.micro_batches] == [((m, 0, 3),) for m in "abcd"]


def test_requests_of_different_kinds_never_share():
    reqs = [RequestShape("a", (10, 10), kind="graph"), RequestShape("b", (10,), kind="eager"), RequestShape("c", (10,), kind="graph")]
    plan = pack(reqs, 4096, may_mix=always)
    assert sorted((mb.kind, sorted(s[0] for s in mb.segments)) for mb in plan.micro_batches) == [
        ("eager", ["b"]), ("graph", ["a", "c"])]


def test_gradient_micro_batches_come_first_then_forward_only():
    reqs = [RequestShape("a", (10,), forward_only=True), RequestShape("b", (40,)), RequestShape("c", (10,))]
    plan = pack(reqs, 4096, may_mix=always)
    assert [mb.grad for mb in plan.micro_batches] == [True, True, False]
    assert plan.counts() == (2, 1)
    assert [mb.width for mb in plan.phase(True)] == [16, 48]


def test_adapters_of_one_shape_sit_side_by_side():
    reqs = [RequestShape(m, (10,)) for m in "abcd"]
    rank = {"a": 8, "b": 16, "c": 8, "d": 16}
    plan = pack(reqs, 4096, may_mix=always, order_key=lambda m: (rank[m],))
    assert [s[0] for s in plan.micro_batches[0].segments] == ["a", "c", "b", "d"]


def test_runs_and_segments_describe_the_rows():
    reqs = [RequestShape("a", (10, 12)), RequestShape("a", (11,)), RequestShape("b", (9,))]
    mb = pack(reqs, 4096, may_mix=always).micro_batches[0]
    # pieces of one shape by size, then model id: b's one row, then a's three
    assert mb.rows == ((2, 0), (0, 0), (0, 1), (1, 0))
    assert mb.lengths == (9, 10, 12, 11) and mb.tokens == 42 and mb.padded_tokens == 64
    assert mb.segments == (("b", 0, 1), ("a", 1, 4))
    assert mb.runs == ((2, 0, 1), (0, 1, 3), (1, 3, 4))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.lists(st.integers(1, 300), min_size=1, max_size=6),
                          st.booleans(), st.sampled_from([0, 1])), min_size=1, max_size=10),
       st.sampled_from([64, 256, 1024]), st.booleans())
def test_every_row_runs_once_and_each_model_keeps_its_solo_pieces(spec, budget, mix):
    reqs = [RequestShape(m, tuple(lengths), fwd, kind) for m, lengths, fwd, kind in spec]
    plan = pack(reqs, budget, may_mix=always if mix else never)
    seen = [row for mb in plan.micro_batches for row in mb.rows]
    assert sorted(seen) == sorted((ri, di) for ri, r in enumerate(reqs) for di in range(len(r.lengths)))
    for mb in plan.micro_batches:
        assert all(bucket_width(n) == mb.width for n in mb.lengths)
        assert mb.padded_tokens <= budget or len(mb.rows) == 1
        assert len({reqs[ri].kind for ri, _ in mb.rows}) == 1
    for model in {r.model_id for r in reqs}:
        own = [(i, r) for i, r in enumerate(reqs) if r.model_id == model]
        solo = pack([r for _, r in own], budget, may_mix=always if mix else never)
        index = {i: k for k, (i, _) in enumerate(own)}
        renamed = [(g, w, tuple((index[ri], di) for ri, di in rows)) for g, w, rows in rows_of(plan, reqs, model)]
        assert renamed == rows_of(solo, [r for _, r in own], model)
