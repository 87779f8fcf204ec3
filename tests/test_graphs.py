"""Training steps as captured graphs (runtime/graphs.py): the runtime's side, on CPU.

CUDA graphs need CUDA, which this machine has not: these tests put a stand-in in place of the
capture (`RerunCapture`, a mock of torch.cuda.CUDAGraph and nothing else). It records the step
and, on every replay, runs it again on the same static input buffers, writing into the same
static outputs -- so what is checked is everything the runtime does around a graph: inputs only
through the static buffers, outputs copied out before the next replay, the warm-up's gradients
put back, one graph per layout and a new one where the adapters' slots or storage changed, and
losses that compute on the host kept eager and apart. tests/test_gpu_training.py runs the real
graphs on a GPU (HOSTED_TINKER_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.graphs import StepGraphs
from hosted_tinker.runtime.invariance import same_bits
from hosted_tinker.runtime.trainer import EAGER, GRAPHED, TrainingRuntime
from helpers import TENANTS, RerunCapture, random_work, train_tenants

CPU = torch.device("cpu")


def runtime_pair(path):
    """Two runtimes on two copies of the embedded model: steps eager, and steps as (stand-in) graphs."""
    def make():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return TrainingRuntime(model, "embedded", device=CPU, max_tokens_per_micro_batch=1024)
    eager, graphed = make(), make()
    graphed.graphs = StepGraphs(RerunCapture())
    return eager, graphed


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    return runtime_pair(ensure_embedded_model(tmp_path_factory.mktemp("models")))


def assert_same_training(a, b):
    (hist_a, state_a), (hist_b, state_b) = a, b
    for i in hist_a:
        for (oa, na), (ob, nb) in zip(hist_a[i], hist_b[i]):
            assert oa.metrics == ob.metrics and na == nb, i
            for da, db in zip(oa.outputs, ob.outputs):
                for key in ("logprobs", "elementwise_loss"):
                    assert same_bits(torch.from_numpy(da[key]), torch.from_numpy(db[key])), (i, key)
        for k in state_a[i]:
            assert same_bits(state_a[i][k], state_b[i][k]), (i, k)


def test_graphed_steps_give_the_eager_steps_bits(runtimes):
    """Eleven tenants (every loss, (N, K) cross_entropy targets too, ranks 1-32, ragged lengths,
    gspo among them), three steps: a layout's first step captures it, later ones replay; every
    result equals the eager runtime's."""
    eager, graphed = runtimes
    tenants = list(range(len(TENANTS)))
    expected = train_tenants(eager, tenants, steps=3)
    got = train_tenants(graphed, tenants, steps=3)
    assert_same_training(expected, got)
    graphs = graphed.graphs
    captured, replayed = graphs.captures, graphs.replays
    assert captured > 0 and replayed >= captured  # a new layout's first result is its first replay
    # The same training again: the same layouts (slots, configs and lengths), all replayed; each
    # step's values differ from the step that captured the layout, so replays read their own inputs.
    again = train_tenants(graphed, tenants, steps=3)
    assert_same_training(expected, again)
    assert graphs.captures == captured and graphs.replays == 2 * replayed


def test_replays_read_each_steps_own_inputs(runtimes):
    """Fixed lengths, new values every step: one layout, captured once, replayed with new data."""
    results = []
    for rt in runtimes:
        for mid in list(rt.adapters):
            rt.remove_adapter(mid)
        for i in (0, 1, 4):
            rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i))
        outs = []
        for step in range(4):
            works = [random_work(40 * step + i, f"t{i}", TENANTS[i][0], TENANTS[i][1], lengths=(30, 17))
                     for i in (0, 1, 4)]
            outs.append([o.outputs[0]["logprobs"] for o in rt.forward_backward(works)])
            outs.append([rt.optim_step(f"t{i}", AdamParams(learning_rate=1e-2))["grad_norm"] for i in (0, 1, 4)])
        results.append(outs)
    for a, b in zip(*results):
        for x, y in zip(a, b):
            assert same_bits(torch.as_tensor(x), torch.as_tensor(y))


def test_gradients_accumulated_over_calls_survive_a_capture_in_between(runtimes):
    """Two forward_backward calls before one optim step, the second of a layout never seen: its
    capture's warm-up must not add to (or drop) the first call's gradients."""
    results = []
    for rt in runtimes:
        for mid in list(rt.adapters):
            rt.remove_adapter(mid)
        rt.create_adapter("a", LoRAConfig(rank=4, seed=3))
        rt.forward_backward([random_work(1, "a", "cross_entropy", {}, lengths=(30, 31))])
        rt.forward_backward([random_work(2, "a", "cross_entropy", {}, lengths=(70, 5, 200))])
        norm = rt.optim_step("a", AdamParams(learning_rate=1e-2))["grad_norm"]
        results.append((norm, [t.clone() for t in rt.adapter("a").parameters()]))
    (n1, w1), (n2, w2) = results
    assert n1 == n2 and all(same_bits(a, b) for a, b in zip(w1, w2))


def test_a_new_graph_where_slots_or_their_storage_change(runtimes):
    """The key holds each adapter's config and slots and the stacks' storage version: a stack that
    grows (more adapters than its slots) or an adapter re-made with another rank gets new graphs,
    and the results still equal eager ones."""
    eager, graphed = runtimes
    for rt in runtimes:
        for mid in list(rt.adapters):
            rt.remove_adapter(mid)
    work = random_work(7, "x", "cross_entropy", {}, lengths=(20,))
    results = {id(rt): [] for rt in runtimes}
    for rank, extra in ((4, 0), (4, 6), (8, 0)):
        for rt in runtimes:
            if "x" in rt.adapters:
                rt.remove_adapter("x")
            rt.create_adapter("x", LoRAConfig(rank=rank, seed=1))
            for k in range(extra):  # fills rank 4's four slots and grows its stacks
                rt.create_adapter(f"pad{rank}-{k}", LoRAConfig(rank=rank, seed=50 + k))
            out = rt.forward_backward([work])[0]
            results[id(rt)].append(out.outputs[0]["logprobs"])
            rt.optim_step("x", AdamParams(learning_rate=1e-2))
    before = graphed.graphs.captures
    assert graphed.routing.storage_version > 0
    for a, b in zip(results[id(eager)], results[id(graphed)]):
        assert same_bits(torch.from_numpy(a), torch.from_numpy(b))
    graphed.forward_backward([work])  # the same layout, adapter and storage again: a replay
    assert graphed.graphs.captures == before


def test_losses_computed_on_the_host_run_eagerly_in_micro_batches_of_their_own(runtimes):
    _, graphed = runtimes
    for rt in runtimes:
        for mid in list(rt.adapters):
            rt.remove_adapter(mid)
        for i in (0, 8):  # cross_entropy, gspo
            rt.create_adapter(f"t{i}", LoRAConfig(rank=8, seed=i))
    works = [random_work(i, f"t{i}", TENANTS[i][0], TENANTS[i][1], lengths=(20, 20)) for i in (0, 8)]
    plan = graphed.plan(works)
    assert sorted((mb.kind, [s[0] for s in mb.segments]) for mb in plan.micro_batches) == [
        (EAGER, ["t8"]), (GRAPHED, ["t0"])]
    eager_plan = runtimes[0].plan(works)  # without graphs, one kind: they may share
    assert {mb.kind for mb in eager_plan.micro_batches} == {0}


def test_a_graph_keeps_the_slot_index_tensors_its_kernels_read(runtimes):
    """Plans (and their slot index tensors on the device) are dropped whenever a slot is taken or
    freed, but a graph captured over them still reads those tensors on every replay: it must keep
    them alive, or their memory is reused under it (on an H200 that replayed garbage indices into
    an index_select: a device-side assert)."""
    import gc
    import weakref

    _, graphed = runtimes
    for mid in list(graphed.adapters):
        graphed.remove_adapter(mid)
    for seed in (1, 2, 3):  # three of one shape, slots out of order after the middle one is re-made
        graphed.create_adapter(f"k{seed}", LoRAConfig(rank=2, seed=seed))
    graphed.remove_adapter("k2")
    graphed.create_adapter("k2", LoRAConfig(rank=2, seed=2))
    works = [random_work(60 + i, f"k{i}", "cross_entropy", {}, lengths=(12,)) for i in (1, 2, 3)]
    graphed.forward_backward(works)
    tensors = [call.slots for plan in graphed.routing.last_plans.values() if plan is not None
               for call in plan.calls if call is not None]
    assert tensors
    refs = [weakref.ref(t) for t in tensors]
    del tensors
    graphed.create_adapter("another", LoRAConfig(rank=2, seed=9))  # a new slot: every plan dropped
    graphed.forward_backward([random_work(70, "another", "cross_entropy", {}, lengths=(40,))])  # other plans
    gc.collect()
    assert all(r() is not None for r in refs)
