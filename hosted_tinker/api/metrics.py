"""`/metrics` (Prometheus, rendered by prometheus_client) and the recent-cycle history the dashboard shows.

Two kinds of series:

* histograms and counters observed as things happen: request latency by route (the access-log
  middleware), queue wait, cycle time, fused-pass tokens and tenants (the server's observer: the
  device loop's `on_cycle`), sampling time to first token and tokens per second (the sampling
  engine's `on_request_done`), vLLM request latency (the vLLM backend's `on_request_done`);
* values the components already keep (cycles run, queue depth, adapters), read from their
  attributes at scrape time by `_ServerCollector`, under the names they always had; and each
  model's sampling backend's own (sampled tokens, KV cache, and with a vLLM sidecar its adapter
  syncs, sync lag, restarts...), which it reports as `Series` (`SamplingBackend.metrics`).

Each app has its own registry, so several servers in one process (tests) never share series.
What a served base model's own parts do (its cycles, queue, adapters, sampling) carries a
`base_model` label: each model has its own device loop; sum over the label for the server.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..sampling.jobs import SampleJob, SampleResult
    from ..server.served_models import ServedModel
    from ..training.cycle_plan import CyclePlan
    from ..server.core import Server

# The *_created series would double the output for no reader we know of.
disable_created_metrics()

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKENS = tuple(float(1 << k) for k in range(4, 21))  # 16 ... 1M
_TENANTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
_RATES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
CYCLE_HISTORY = 600  # cycles the dashboard's utilisation chart can show


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hosted_tinker_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.request_seconds = Counter("hosted_tinker_http_request_seconds", "time spent answering, by route",
                                       ["route"], registry=r)
        self.request_latency = Histogram("hosted_tinker_http_request_duration_seconds",
                                         "time to answer a request, by route", ["route"], buckets=_SECONDS,
                                         registry=r)
        self.queue_wait = Histogram("hosted_tinker_queue_wait_seconds",
                                    "time a training request waited between arriving and its cycle starting, by kind",
                                    ["base_model", "kind"], buckets=_SECONDS, registry=r)
        self.cycle_duration = Histogram("hosted_tinker_cycle_duration_seconds", "duration of a clock cycle",
                                        ["base_model"], buckets=_SECONDS, registry=r)
        self.fused_tokens = Histogram("hosted_tinker_fused_pass_tokens", "tokens in a fused forward/backward pass",
                                      ["base_model"], buckets=_TOKENS, registry=r)
        self.fused_runs = [Histogram(name, help, ["base_model"], buckets=_TENANTS, registry=r)
                           for name, help in _with_old_names("hosted_tinker_fused_pass_training_runs",
                                                             "training runs in a fused forward/backward pass")]
        self.ttft = Histogram("hosted_tinker_sampling_time_to_first_token_seconds",
                              "time from a sample request's arrival to its first generated token", ["base_model"],
                              buckets=_SECONDS, registry=r)
        self.tokens_per_second = Histogram("hosted_tinker_sampling_tokens_per_second",
                                           "generated tokens per second of a sample request, after its first token",
                                           ["base_model"], buckets=_RATES, registry=r)
        self.vllm_request_latency = Histogram(
            "hosted_tinker_vllm_request_duration_seconds",
            "time from a sample job's hand-over to the vLLM sidecar to its answer (waiting for vLLM included), by "
            "outcome", ["base_model", "outcome"], buckets=_SECONDS, registry=r)
        self._server: Server | None = None
        r.register(_ServerCollector(lambda: self._server))
        self._lock = threading.Lock()
        self._cycles: deque[dict] = deque(maxlen=CYCLE_HISTORY)

    def bind(self, server: "Server") -> None:
        """Read the server's own counters at scrape time (its observer since it was built)."""
        self._server = server

    # -- observations ------------------------------------------------------------------------------
    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.request_seconds.labels(route).inc(seconds)
        self.request_latency.labels(route).observe(seconds)

    def observe_cycle(self, base_model: str, plan: "CyclePlan", seconds: float) -> None:
        """Called on `base_model`'s device loop thread after each of its training cycles."""
        started = time.monotonic() - seconds
        for req in (*plan.compute, *plan.optim, *plan.tail):
            self.queue_wait.labels(base_model, req.kind).observe(max(0.0, started - req.arrived_at))
        self.cycle_duration.labels(base_model).observe(seconds)
        tokens = tenants = queued = 0
        if self._server is not None:
            served = self._server.models.get(base_model)
            queued = served.scheduler.queue_depth()
            if plan.compute:
                stats = served.runtime.last_pass
                tokens, tenants = stats.tokens, stats.models
                self.fused_tokens.labels(base_model).observe(tokens)
                for histogram in self.fused_runs:
                    histogram.labels(base_model).observe(tenants)
        with self._lock:
            self._cycles.append({"t": time.time(), "base_model": base_model, "seconds": seconds, "tokens": tokens,
                                 "tenants": tenants, "requests": len(plan.compute) + len(plan.optim) + len(plan.tail),
                                 "queue_depth": queued})

    def observe_sample(self, base_model: str, job: "SampleJob", generated_tokens: int) -> None:
        """Called on `base_model`'s device loop thread when a sample request has all its sequences."""
        if job.first_token_at is None:
            return
        now = time.perf_counter()
        self.ttft.labels(base_model).observe(job.first_token_at - job.submitted_at)
        decoding = now - job.first_token_at
        if decoding > 0 and generated_tokens > job.num_samples:
            self.tokens_per_second.labels(base_model).observe((generated_tokens - job.num_samples) / decoding)

    def observe_vllm_request(self, base_model: str, job: "SampleJob", result: "SampleResult | None",
                             seconds: float) -> None:
        """Called on the vLLM backend's thread when a job it ran ends (result None: it failed or was cancelled)."""
        self.vllm_request_latency.labels(base_model, "ok" if result is not None else "failed").observe(seconds)
        if result is not None:
            self.observe_sample(base_model, job, sum(len(s.tokens) for s in result.sequences))

    def recent_cycles(self) -> list[dict]:
        with self._lock:
            return list(self._cycles)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_C, _G = CounterMetricFamily, GaugeMetricFamily


# Series renamed (a training run was called a "model"), old name -> new: the old one is still
# reported, marked deprecated, until the next release.
RENAMED_SERIES = {"hosted_tinker_last_cycle_models": "hosted_tinker_last_cycle_training_runs",
                  "hosted_tinker_last_fused_pass_models": "hosted_tinker_last_fused_pass_training_runs",
                  "hosted_tinker_pipelining_models": "hosted_tinker_pipelining_training_runs",
                  "hosted_tinker_fused_pass_models": "hosted_tinker_fused_pass_training_runs"}


def _with_old_names(name: str, help: str) -> list[tuple[str, str]]:
    """(name, help) of a series, then of each old name it is still reported under (`RENAMED_SERIES`)."""
    return [(name, help)] + [(old, f"deprecated, goes in the next release: the old name of {name}")
                             for old, new in RENAMED_SERIES.items() if new == name]


# (family, name, help, value of one served model), read from its own parts at scrape time (its
# sampling backend reports its own: `_backend_families`).
_PER_MODEL: list[tuple[type, str, str, Callable[["ServedModel"], float]]] = [
    (_C, "hosted_tinker_cycles", "clock cycles started (counted before the cycle answers anything)",
     lambda m: m.scheduler.cycles),
    (_C, "hosted_tinker_cycle_seconds", "time spent in clock cycles", lambda m: m.scheduler.cycle_seconds_total),
    (_G, "hosted_tinker_last_cycle_seconds", "duration of the last cycle", lambda m: m.scheduler.last_cycle_seconds),
    (_G, "hosted_tinker_last_cycle_training_runs", "training runs served by the last cycle",
     lambda m: m.scheduler.last_cycle_models),
    (_G, "hosted_tinker_last_cycle_requests", "requests executed by the last cycle",
     lambda m: m.scheduler.last_cycle_requests),
    (_G, "hosted_tinker_last_fused_pass_training_runs", "training runs packed into the last fused forward/backward",
     lambda m: m.worker.compute.last_cycle_models),
    (_G, "hosted_tinker_last_fused_pass_tokens", "tokens in the last fused forward/backward",
     lambda m: m.worker.compute.last_cycle_tokens),
    (_G, "hosted_tinker_last_fused_pass_padded_tokens",
     "token slots computed by the last fused pass, padding included (vs _tokens: padding waste)",
     lambda m: m.runtime.last_pass.padded_tokens),
    (_C, "hosted_tinker_fused_passes", "forward/backward passes that carried several training runs",
     lambda m: m.worker.compute.fused_passes),
    (_C, "hosted_tinker_trained_tokens", "tokens through forward/backward", lambda m: m.worker.compute.tokens_total),
    (_C, "hosted_tinker_failed_passes", "forward/backward passes that raised (a pass of several requests is rerun in "
     "halves until the request that made it raise fails alone)", lambda m: m.worker.compute.failed_passes),
    (_C, "hosted_tinker_isolation_reruns", "passes run again to find which request made a pass raise",
     lambda m: m.worker.compute.isolation_reruns),
    (_G, "hosted_tinker_quarantined_keys", "API keys whose request made a pass raise alone: their requests run in a "
     "pass of their own for a while", lambda m: len(m.worker.compute.quarantine)),
    (_G, "hosted_tinker_requests_in_parts", "requests running in parts (over max_tokens_per_cycle), between parts",
     lambda m: len(m.worker.compute.parts)),
    (_C, "hosted_tinker_parts_rolled_back", "requests in parts that failed after a part: their earlier parts' "
     "gradients put back", lambda m: m.worker.compute.parts.rolled_back),
    (_C, "hosted_tinker_failed_requests_rolled_back", "models whose gradients were put back as before a pass, a "
     "forward_backward of it having failed after the pass", lambda m: m.worker.compute.launched.rolled_back),
    (_G, "hosted_tinker_queue_depth", "training requests waiting", lambda m: m.scheduler.queue_depth()),
    (_G, "hosted_tinker_pipelining_training_runs",
     "training runs whose client pipelines (posts optim_step before its forward_backward result): the cycle "
     "running their forward_backward waits up to gather_window_s for it while the pass runs, so that both share it",
     lambda m: m.scheduler.pipelining_models()),
    (_G, "hosted_tinker_adapters", "adapters held by the runtime (on the device or paged out)",
     lambda m: len(m.runtime.adapters)),
    (_G, "hosted_tinker_live_adapters", "adapters resident on the device", lambda m: len(m.runtime.live)),
    (_C, "hosted_tinker_adapter_page_outs", "adapters paged out to CPU memory", lambda m: m.runtime.page_outs),
    (_C, "hosted_tinker_images_decoded",
     "images processed for the model (a request's, shortly before its pass or prefill; a refused request "
     "decodes none)", lambda m: 0 if m.images is None else m.images.decoded),
]


class _ServerCollector(Collector):
    """Series read from the components' own counters when /metrics is scraped."""

    def __init__(self, server: Callable[[], "Server | None"]):
        self._server = server

    def collect(self):
        server = self._server()
        if server is None:
            return
        for family, name, help, value in _PER_MODEL:
            for series, text in _with_old_names(name, help):
                metric = family(series, text, labels=["base_model"])
                for served in server.models:
                    metric.add_metric([served.name], value(served))
                yield metric
        yield from _backend_families(server.models)
        yield CounterMetricFamily("hosted_tinker_futures_resolved", "futures resolved",
                                  value=server.futures.resolved_total)
        yield GaugeMetricFamily("hosted_tinker_image_decodes_running", "image decodes running now (checks of arriving "
                                "requests and processings before a pass or prefill; max_image_decodes)",
                                value=server.image_decodes.running)
        yield GaugeMetricFamily("hosted_tinker_image_decodes_waiting", "requests' images waiting to be processed "
                                "for their pass or prefill", value=server.image_decodes.waiting)
        yield GaugeMetricFamily("hosted_tinker_cpu_threads", "torch's CPU threads (--cpu-threads)",
                                value=torch.get_num_threads())
        yield from _retention_families(server)
        if torch.cuda.is_available():
            g = GaugeMetricFamily("hosted_tinker_gpu_memory_allocated_bytes", "GPU memory held by tensors",
                                  labels=["device"])
            for i in range(torch.cuda.device_count()):
                g.add_metric([str(i)], torch.cuda.memory_allocated(i))
            yield g
        try:
            import resource
        except ImportError:  # pragma: no cover - not on Linux
            return
        yield GaugeMetricFamily("hosted_tinker_process_max_rss_bytes", "peak resident memory of the server",
                                value=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _retention_families(server: "Server") -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    """The data dir by kind, as the retention sweep last measured it, and what the sweep removed."""
    retention = server.retention
    size = GaugeMetricFamily("hosted_tinker_data_dir_bytes", "bytes in the data dir by kind: database/<table group> "
                             "(requests, timings, losses, audit, usage, sample_records, catalog; free pages, wal), "
                             "checkpoints, snapshots (ephemeral sampler), telemetry, traces, models, other; as the "
                             "retention sweep last measured them", labels=["kind"])
    for kind, n in sorted(retention.usage.items()):
        size.add_metric([kind], n)
    yield size
    yield CounterMetricFamily("hosted_tinker_retention_sweeps", "retention sweeps done (--retention-sweep-s)",
                              value=retention.sweeps)
    removed = CounterMetricFamily("hosted_tinker_retention_removed", "what the retention sweep removed: rows of a "
                                  "table, fetched results, snapshots", labels=["what"])
    for what, n in sorted(retention.removed.items()):
        removed.add_metric([what], n)
    yield removed


def _backend_families(models: Iterable["ServedModel"]) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
    """One family per series the models' sampling backends report, each model's value labelled
    with its name (a model whose backend does not report a series is not in its family)."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for served in models:
        for series in served.sampling_backend.metrics():
            if series.name not in families:
                families[series.name] = (_C if series.counter else _G)(series.name, series.help, labels=["base_model"])
            families[series.name].add_metric([served.name], series.value)
    return families.values()
