"""`/metrics` in Prometheus text format: what an operator watches."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            self.seconds[route] += seconds

    def render(self, server) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]):
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        with self._lock:
            reqs = sorted(self.requests.items())
            secs = sorted(self.seconds.items())
        metric("hosted_tinker_http_requests_total", "counter", "HTTP requests by route and status",
               [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in reqs])
        metric("hosted_tinker_http_request_seconds_total", "counter", "time spent answering, by route",
               [(f'{{route="{r}"}}', v) for r, v in secs])
        sch, wk, rt = server.scheduler, server.worker, server.runtime
        metric("hosted_tinker_cycles_total", "counter", "clock cycles run", [("", sch.cycles)])
        metric("hosted_tinker_cycle_seconds_total", "counter", "time spent in clock cycles",
               [("", sch.cycle_seconds_total)])
        metric("hosted_tinker_last_cycle_seconds", "gauge", "duration of the last cycle", [("", sch.last_cycle_seconds)])
        metric("hosted_tinker_last_cycle_models", "gauge", "models served by the last cycle",
               [("", sch.last_cycle_models)])
        metric("hosted_tinker_last_cycle_requests", "gauge", "requests executed by the last cycle",
               [("", sch.last_cycle_requests)])
        metric("hosted_tinker_last_fused_pass_models", "gauge", "adapters packed into the last fused forward/backward",
               [("", wk.last_cycle_models)])
        metric("hosted_tinker_last_fused_pass_tokens", "gauge", "tokens in the last fused forward/backward",
               [("", wk.last_cycle_tokens)])
        metric("hosted_tinker_last_fused_pass_padded_tokens", "gauge",
               "token slots computed by the last fused pass, padding included (vs _tokens: padding waste)",
               [("", rt.last_pass.padded_tokens)])
        metric("hosted_tinker_fused_passes_total", "counter", "forward/backward passes that carried several models",
               [("", wk.fused_passes)])
        metric("hosted_tinker_trained_tokens_total", "counter", "tokens through forward/backward", [("", wk.tokens_total)])
        metric("hosted_tinker_queue_depth", "gauge", "training requests waiting", [("", sch.queue_depth())])
        metric("hosted_tinker_adapters", "gauge", "adapters held by the runtime (on the device or paged out)",
               [("", len(rt.adapters))])
        metric("hosted_tinker_live_adapters", "gauge", "adapters resident on the device", [("", len(rt.live))])
        metric("hosted_tinker_adapter_page_outs_total", "counter", "adapters paged out to CPU memory",
               [("", rt.page_outs)])
        metric("hosted_tinker_futures_resolved_total", "counter", "futures resolved", [("", server.futures.resolved_total)])
        if torch.cuda.is_available():
            metric("hosted_tinker_gpu_memory_allocated_bytes", "gauge", "GPU memory held by tensors",
                   [(f'{{device="{i}"}}', torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count())])
        try:
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            metric("hosted_tinker_process_max_rss_bytes", "gauge", "peak resident memory of the server", [("", rss)])
        except ImportError:  # pragma: no cover - not on Linux
            pass
        return "\n".join(lines) + "\n"
