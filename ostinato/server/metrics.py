"""Prometheus metrics, in a registry of the server's own.

A registry per server (not prometheus_client's global one) so that two servers in one
process, as in the tests, do not collide. Token counters are fed by the engine thread
when a generation ends, cancelled ones included, so they count the work actually done;
request counts and TTFT are taken on the request side, where the client's wait is
seen. The placement counters are whatever `runner.placement_stats()` returns (routes,
cold routes, CPU experts, bytes uploaded, ...), as `ostinato_placement_*` gauges, plus
the cold-route share when routes are counted; the engine thread takes them after each
request (only it touches the runner), the scrape reads that copy. So it is with the
conversations held beside the slot (engine/conversations.py): their count, their bytes, and
the host memory their pool took.
"""
from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ostinato.engine.session import GenerationStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class _PlacementCollector:
    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        stats = dict(self.worker.placement)
        if stats.get("routes") and "cold_routes" in stats:
            stats.setdefault("cold_route_share", stats["cold_routes"] / stats["routes"])
        for key, value in sorted(stats.items()):
            name = "ostinato_placement_" + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
            family = GaugeMetricFamily(name, f"experts placement: {key} (from runner.placement_stats())")
            family.add_metric([], float(value))
            yield family


class Metrics:
    def __init__(self, worker):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ostinato_requests", "HTTP requests by endpoint and status (499: client went away)",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("ostinato_time_to_first_token_seconds", "arrival to first token, queueing included",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ostinato_time_per_output_token_seconds", "mean time per token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ostinato_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("ostinato_cached_prompt_tokens", "prompt tokens whose KV cache was reused",
                                     registry=r)
        self.restored_tokens = Counter("ostinato_restored_tokens", "cached prompt tokens whose KV was copied back "
                                       "from a held conversation (not kept in the slot)", registry=r)
        self.generated_tokens = Counter("ostinato_generated_tokens", "tokens generated (or forced)", registry=r)
        Gauge("ostinato_kv_conversations", "conversations whose KV copy is held besides the slot's "
              "(--kv-conversations)", registry=r).set_function(lambda: worker.conversations["held"])
        Gauge("ostinato_kv_conversation_bytes", "host memory the held KV copies take",
              registry=r).set_function(lambda: worker.conversations["bytes"])
        Gauge("ostinato_kv_conversation_pool_bytes", "host memory taken for KV copies, free blocks included "
              "(--kv-cache-memory caps it)", registry=r).set_function(lambda: worker.conversations["pool"])
        Gauge("ostinato_queue_depth", "requests waiting for the engine", registry=r).set_function(
            lambda: worker.queued)
        Gauge("ostinato_ready", "1 once the model is loaded", registry=r).set_function(
            lambda: float(worker.state == "ok"))
        r.register(_PlacementCollector(worker))

    def on_finished(self, stats: GenerationStats) -> None:
        """Called on the engine thread after every generation, however it ended."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.restored_tokens.inc(stats.restored_tokens)
        self.generated_tokens.inc(stats.output_tokens)
        if stats.output_tokens > 1:
            self.tpot.observe(stats.decode_s / (stats.output_tokens - 1))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
