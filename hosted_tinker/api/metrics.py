"""`/metrics` (Prometheus, rendered by prometheus_client) and the recent-cycle history the dashboard shows.

Two kinds of series:

* histograms and counters observed as things happen: request latency by route (the access-log
  middleware), queue wait, cycle time, fused-pass tokens and tenants (the server's observer: the
  device loop's `on_cycle`), sampling time to first token and tokens per second (the sampling
  engine's `on_request_done`), vLLM request latency (the vLLM backend's `on_request_done`);
* values the components already keep (cycles run, queue depth, adapters, sampled tokens, and
  with a vLLM sidecar its adapter syncs, sync lag, restarts...), read from their attributes at
  scrape time by `_ServerCollector`, under the names they always had.

Each app has its own registry, so several servers in one process (tests) never share series.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.registry import Collector

from ..sampling.vllm_server_backend import VLLMBackend

if TYPE_CHECKING:
    from ..sampling.engine import SampleJob, SampleResult
    from ..scheduler import CyclePlan
    from ..server import Server

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
                                    ["kind"], buckets=_SECONDS, registry=r)
        self.cycle_duration = Histogram("hosted_tinker_cycle_duration_seconds", "duration of a clock cycle",
                                        buckets=_SECONDS, registry=r)
        self.fused_tokens = Histogram("hosted_tinker_fused_pass_tokens", "tokens in a fused forward/backward pass",
                                      buckets=_TOKENS, registry=r)
        self.fused_models = Histogram("hosted_tinker_fused_pass_models",
                                      "tenants (adapters) in a fused forward/backward pass", buckets=_TENANTS,
                                      registry=r)
        self.ttft = Histogram("hosted_tinker_sampling_time_to_first_token_seconds",
                              "time from a sample request's arrival to its first generated token", buckets=_SECONDS,
                              registry=r)
        self.tokens_per_second = Histogram("hosted_tinker_sampling_tokens_per_second",
                                           "generated tokens per second of a sample request, after its first token",
                                           buckets=_RATES, registry=r)
        self.vllm_request_latency = Histogram(
            "hosted_tinker_vllm_request_duration_seconds",
            "time from a sample job's hand-over to the vLLM sidecar to its answer (waiting for vLLM included), by "
            "outcome", ["outcome"], buckets=_SECONDS, registry=r)
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

    def observe_cycle(self, plan: "CyclePlan", seconds: float) -> None:
        """Called on the device loop's thread after each training cycle."""
        started = time.monotonic() - seconds
        for req in (*plan.compute, *plan.optim, *plan.tail):
            self.queue_wait.labels(req.kind).observe(max(0.0, started - req.arrived_at))
        self.cycle_duration.observe(seconds)
        tokens = tenants = 0
        if plan.compute and self._server is not None:
            stats = self._server.runtime.last_pass
            tokens, tenants = stats.tokens, stats.models
            self.fused_tokens.observe(tokens)
            self.fused_models.observe(tenants)
        queued = self._server.scheduler.queue_depth() if self._server is not None else 0
        with self._lock:
            self._cycles.append({"t": time.time(), "seconds": seconds, "tokens": tokens, "tenants": tenants,
                                 "requests": len(plan.compute) + len(plan.optim) + len(plan.tail),
                                 "queue_depth": queued})

    def observe_sample(self, job: "SampleJob", generated_tokens: int) -> None:
        """Called on the device loop's thread when a sample request has all its sequences."""
        if job.first_token_at is None:
            return
        now = time.perf_counter()
        self.ttft.observe(job.first_token_at - job.submitted_at)
        decoding = now - job.first_token_at
        if decoding > 0 and generated_tokens > job.num_samples:
            self.tokens_per_second.observe((generated_tokens - job.num_samples) / decoding)

    def observe_vllm_request(self, job: "SampleJob", result: "SampleResult | None", seconds: float) -> None:
        """Called on the vLLM backend's thread when a job it ran ends (result None: it failed or was cancelled)."""
        self.vllm_request_latency.labels("ok" if result is not None else "failed").observe(seconds)
        if result is not None:
            self.observe_sample(job, sum(len(s.tokens) for s in result.sequences))

    def recent_cycles(self) -> list[dict]:
        with self._lock:
            return list(self._cycles)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServerCollector(Collector):
    """Series read from the components' own counters when /metrics is scraped."""

    def __init__(self, server: Callable[[], "Server | None"]):
        self._server = server

    def collect(self):
        server = self._server()
        if server is None:
            return
        sch, wk, rt = server.scheduler, server.worker, server.runtime
        backend = server.models.default.sampling_backend
        builtin = backend.builtin if isinstance(backend, VLLMBackend) else backend
        engine, snapshots = builtin.engine, builtin.snapshots  # the built-in engine's counters

        def counter(name: str, help: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, help, value=value)

        def gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help, value=value)

        yield counter("hosted_tinker_cycles", "clock cycles run", sch.cycles)
        yield counter("hosted_tinker_cycle_seconds", "time spent in clock cycles", sch.cycle_seconds_total)
        yield gauge("hosted_tinker_last_cycle_seconds", "duration of the last cycle", sch.last_cycle_seconds)
        yield gauge("hosted_tinker_last_cycle_models", "models served by the last cycle", sch.last_cycle_models)
        yield gauge("hosted_tinker_last_cycle_requests", "requests executed by the last cycle",
                    sch.last_cycle_requests)
        yield gauge("hosted_tinker_last_fused_pass_models", "adapters packed into the last fused forward/backward",
                    wk.last_cycle_models)
        yield gauge("hosted_tinker_last_fused_pass_tokens", "tokens in the last fused forward/backward",
                    wk.last_cycle_tokens)
        yield gauge("hosted_tinker_last_fused_pass_padded_tokens",
                    "token slots computed by the last fused pass, padding included (vs _tokens: padding waste)",
                    rt.last_pass.padded_tokens)
        yield counter("hosted_tinker_fused_passes", "forward/backward passes that carried several models",
                      wk.fused_passes)
        yield counter("hosted_tinker_trained_tokens", "tokens through forward/backward", wk.tokens_total)
        yield gauge("hosted_tinker_queue_depth", "training requests waiting", sch.queue_depth())
        yield gauge("hosted_tinker_adapters", "adapters held by the runtime (on the device or paged out)",
                    len(rt.adapters))
        yield gauge("hosted_tinker_live_adapters", "adapters resident on the device", len(rt.live))
        yield counter("hosted_tinker_adapter_page_outs", "adapters paged out to CPU memory", rt.page_outs)
        yield counter("hosted_tinker_futures_resolved", "futures resolved", server.futures.resolved_total)
        yield counter("hosted_tinker_sample_requests", "sample requests answered", engine.requests_done)
        yield counter("hosted_tinker_sampled_tokens", "tokens generated by sampling", engine.tokens_generated)
        yield gauge("hosted_tinker_sampling_active_sequences", "sequences being generated now", engine.active_rows)
        yield counter("hosted_tinker_sampling_requests_cancelled",
                      "sample requests dropped unfinished because nobody waited for them any more (client gone)",
                      engine.requests_cancelled)
        yield counter("hosted_tinker_sampler_weight_syncs",
                      "sampler adapter snapshots loaded onto the device (weights synced for sampling)",
                      snapshots.loads)
        yield gauge("hosted_tinker_sampler_snapshots", "sampler adapter snapshots resident on the device",
                    len(snapshots))
        if isinstance(backend, VLLMBackend):
            yield from _vllm_series(backend.metrics())
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
        yield gauge("hosted_tinker_process_max_rss_bytes", "peak resident memory of the server",
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# (name, help, its key in VLLMBackend.metrics(), counter?)
_VLLM_SERIES = (
    ("hosted_tinker_vllm_ready", "1 while the vLLM sidecar answers, 0 while it starts or restarts", "ready", False),
    ("hosted_tinker_vllm_restarts", "times vLLM was found dead and restarted (or, attached, waited for)",
     "restarts_total", True),
    ("hosted_tinker_vllm_last_start_seconds", "how long vLLM's last (re)start took, warm-up included",
     "last_start_seconds", False),
    ("hosted_tinker_vllm_adapter_syncs", "adapter versions written and registered with vLLM after training changed "
     "them", "syncs_total", True),
    ("hosted_tinker_vllm_adapter_sync_failures", "adapter versions that could not be written or registered",
     "sync_failures_total", True),
    ("hosted_tinker_vllm_adapter_on_demand_loads", "adapter versions registered again at use (vLLM evicted or lost "
     "them, or a snapshot's first use)", "on_demand_loads_total", True),
    ("hosted_tinker_vllm_sync_lag_steps", "optimizer steps the most-behind model's version in vLLM lags its training",
     "sync_lag_steps", False),
    ("hosted_tinker_vllm_sync_lag_seconds", "age of the oldest adapter version not yet synced to vLLM (0: none)",
     "sync_lag_seconds", False),
    ("hosted_tinker_vllm_last_sync_seconds", "publish-to-registered time of the last adapter sync", "last_sync_seconds",
     False),
    ("hosted_tinker_vllm_adapter_versions", "adapter versions registered with vLLM (latest versions and snapshots)",
     "registered_versions", False),
    ("hosted_tinker_vllm_requests", "sample jobs the vLLM sidecar ended (answered or failed)", "requests_total", True),
    ("hosted_tinker_vllm_request_failures", "sample jobs on the vLLM sidecar that failed (vLLM down, refused, "
     "cancelled)", "request_failures_total", True),
    ("hosted_tinker_vllm_requests_cancelled", "sample jobs on the vLLM sidecar stopped because their client left",
     "requests_cancelled_total", True),
    ("hosted_tinker_vllm_requests_in_flight", "sample jobs waiting for or running on vLLM", "requests_in_flight",
     False),
    ("hosted_tinker_vllm_sampled_tokens", "tokens generated by vLLM", "tokens_generated_total", True),
    ("hosted_tinker_vllm_jobs_to_builtin", "sample jobs vLLM cannot serve here that went to the built-in engine "
     "(prompt logprobs with lm_head LoRA, or lm_head adapters without it)", "jobs_to_builtin_total", True),
)


def _vllm_series(values: dict[str, float]):
    for name, help, key, is_counter in _VLLM_SERIES:
        family = CounterMetricFamily if is_counter else GaugeMetricFamily
        yield family(name, help, value=values[key])
