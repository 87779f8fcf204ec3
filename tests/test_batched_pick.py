"""One batched pick per decode step (issue 24): every row's token chosen on the device at once, read
back in one copy, with seeded draws that do not depend on the batch.

`BatchPicker` alone (pick.py): its counter-based generator is splitmix64 bit for bit, its draws
follow the tempered, top-k and top-p masked distribution, and a row's draws are its own whatever
else is in the batch. The engine in process on the embedded model (one admission puts jobs in one
group deterministically, which a server's timing cannot): the host reads of a decode step do not
grow with its rows, and a seeded job gives the same tokens alone and among 32 others.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob
from hosted_tinker.sampling.pick import BatchPicker, RowSampling, mix64, uniforms

CPU = torch.device("cpu")
MASK64 = (1 << 64) - 1


def splitmix64_reference(state: int) -> int:
    """splitmix64's finalizer on unsigned Python ints (Steele, Lea, Flood 2014)."""
    z = state & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def signed(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


def test_the_noise_is_splitmix64_bit_for_bit():
    states = [0, 1, 12345, (1 << 63) - 1, 0x9E3779B97F4A7C15, MASK64, 1 << 63]
    got = mix64(torch.tensor([signed(s) for s in states], dtype=torch.int64)).tolist()
    assert got == [signed(splitmix64_reference(s)) for s in states]
    key = signed(splitmix64_reference(42))
    u = uniforms(torch.tensor([key]), step=3).item()
    assert u == (splitmix64_reference(key + 4 * 0x9E3779B97F4A7C15) >> 11) / 2.0 ** 53


def draws(logits: list[float], n: int, **settings) -> torch.Tensor:
    """Token counts of n rows (n distinct keys) picking from the same logits at step 0."""
    fields = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "logprobs_k": 0} | settings
    picker = BatchPicker([RowSampling(key=i, **fields) for i in range(n)], CPU)
    tokens, _ = picker.pick(torch.tensor([logits]).expand(n, -1).contiguous(), step=0)
    return torch.bincount(tokens, minlength=len(logits))


@pytest.mark.parametrize("settings, kept", [({}, [0, 1, 2, 3, 4]), ({"temperature": 0.5}, [0, 1, 2, 3, 4]),
                                            ({"top_k": 2}, [0, 1]), ({"top_p": 0.6}, [0, 1])])
def test_draws_follow_the_tempered_and_masked_distribution(settings, kept):
    logits = [2.0, 1.5, 1.0, 0.0, -1.0]
    n = 40_000
    counts = draws(logits, n, **settings)
    scaled = torch.tensor(logits, dtype=torch.float64) / settings.get("temperature", 1.0)
    p = torch.zeros(5, dtype=torch.float64)
    p[kept] = torch.softmax(scaled[kept], dim=0)
    assert counts[[i for i in range(5) if i not in kept]].sum() == 0  # masked tokens are never drawn
    # Pearson's chi-square over the kept tokens: under 25 (p < 1e-4 at 4 degrees of freedom); the
    # keys are fixed, so this is not flaky. A draw off by 3% on one token scores far above.
    expected = n * p[kept]
    chi2 = float(((counts[kept].double() - expected) ** 2 / expected).sum())
    assert chi2 < 25, (counts.tolist(), expected.tolist())


def test_greedy_rows_take_the_argmax_and_logprobs_are_the_models_own():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 30.0]])
    rows = [RowSampling(temperature=0.0, top_k=-1, top_p=1.0, key=1, logprobs_k=2),
            RowSampling(temperature=0.01, top_k=1, top_p=0.5, key=2, logprobs_k=0),
            RowSampling(temperature=1e-40, top_k=-1, top_p=1.0, key=3, logprobs_k=0)]  # 30 / 1e-40 overflows
    tokens, picks = BatchPicker(rows, CPU).pick(logits, step=0)
    lp = torch.log_softmax(logits, dim=-1)
    assert tokens.tolist() == [1, 0, 3] and [p.token for p in picks] == [1, 0, 3]
    assert [p.logprob for p in picks] == [lp[0, 1].item(), lp[1, 0].item(), lp[2, 3].item()]  # no temperature
    assert picks[0].topk_ids == [1, 3] and picks[0].topk_logprobs == [lp[0, 1].item(), lp[0, 3].item()]
    assert picks[1].topk_ids == [] and picks[0].finite and picks[1].finite


def test_a_rows_draws_do_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 50, generator=gen)
    mine = RowSampling(temperature=1.0, top_k=-1, top_p=1.0, key=7, logprobs_k=0)
    others = [RowSampling(temperature=0.3 + 0.1 * i, top_k=i % 5, top_p=0.5 + 0.01 * i, key=100 + i, logprobs_k=i % 3)
              for i in range(32)]
    for step in range(5):
        alone, _ = BatchPicker([mine], CPU).pick(logits[:1], step)
        batched, _ = BatchPicker(others[:16] + [mine] + others[16:], CPU).pick(
            torch.cat([logits[1:17], logits[:1], logits[17:]]), step)
        assert batched[16] == alone[0]


# -- the engine, in process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> SamplingEngine:
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    runtime = TrainingRuntime(model, "embedded", device=CPU)
    return SamplingEngine(model, runtime.routing, AutoTokenizer.from_pretrained(str(path)), CPU)


HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts tensor -> host reads, apart from those inside the model's forward (transformers'
    own: its mask builder checks the padding mask once per forward, whatever the rows)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.count = collections.Counter()
        self.in_model = False
        self.hooks = [model.register_forward_pre_hook(lambda *a: setattr(self, "in_model", True)),
                      model.register_forward_hook(lambda *a: setattr(self, "in_model", False))]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not self.in_model:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)


def job(i: int, done: list, **fields) -> SampleJob:
    fields = {"temperature": 1.0, "seed": i, "topk_sample_logprobs": 3} | fields
    return SampleJob(prompt=[11, 12, 13 + i % 50] + [20 + i % 7] * (i % 4), num_samples=1, max_tokens=6,
                     adapter_id=None, on_done=done.append, on_error=done.append, **fields)


@pytest.mark.parametrize("rows", [1, 32])
def test_a_decode_step_reads_the_host_once_whatever_its_rows(engine, rows):
    done: list = []
    engine.submit_all([job(i, done, top_k=5 if i % 2 else -1, top_p=0.9 if i % 3 else 1.0) for i in range(rows)])
    with torch.no_grad():
        engine._receive()
        engine._admit(lambda j: None)
        engine._prefill_chunk()  # `rows` rows with their first tokens
        running = [row for job in engine.admission.running for row in job.rows]
        with HostReads(engine.model) as reads:
            engine._decode(running)
    assert sum(reads.count.values()) == 1, reads.count  # the pick's one batch read: all rows' tokens, logprobs, top-k
    assert len(running) == rows and all(len(row.tokens) == 2 for row in running)
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert len(done) == rows and all(len(r.sequences[0].tokens) == 6 for r in done)


def test_a_seeded_job_samples_the_same_alone_and_among_32_others(engine):
    alone: list = []
    engine.submit(job(0, alone, seed=1234))
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    crowd: list = []
    others = [job(i, crowd, temperature=0.5 + i / 32, top_k=i % 4, top_p=0.8 if i % 2 else 1.0)
              for i in range(1, 33)]
    batched: list = []
    engine.submit_all(others[:20] + [job(0, batched, seed=1234)] + others[20:])  # one admission: one group
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert len(crowd) == 32 and len(batched) == 1
    a, b = alone[0].sequences[0], batched[0].sequences[0]
    assert b.tokens == a.tokens
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
