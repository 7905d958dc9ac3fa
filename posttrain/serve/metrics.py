"""The server's Prometheus metrics (`prometheus_client`, one registry per app), exposed at GET /metrics.

Counters: requests by endpoint and status, prompt and completion tokens, sequences by how they ended. Gauges (read when scraped): sequences
waiting for a slot, sequences in slots, slots in all. Histograms: time to first token, inter-token latency (per
token: the time between two arrivals over the tokens that arrived), request duration.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Every metric of one server; `stats()` gives the engine's {"waiting", "running", "slots"} when scraped."""

    def __init__(self, stats: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("posttrain_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("posttrain_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("posttrain_completion_tokens", "Tokens generated", registry=r)
        self.sequences = Counter("posttrain_sequences", "Sequences ended, by how: stop, length, cancelled (a client "
                                 "left or a stop string matched), error", ["finish"], registry=r)
        Gauge("posttrain_queue_depth", "Sequences waiting for a slot", registry=r).set_function(
            lambda: stats()["waiting"])
        Gauge("posttrain_slots_busy", "Sequences in slots", registry=r).set_function(lambda: stats()["running"])
        Gauge("posttrain_slots", "Slots, all models", registry=r).set_function(lambda: stats()["slots"])
        self.ttft = Histogram("posttrain_time_to_first_token_seconds", "From a sequence's arrival to its first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("posttrain_inter_token_latency_seconds", "Time between a sequence's tokens",
                             buckets=_TOKEN, registry=r)
        self.duration = Histogram("posttrain_request_duration_seconds", "From a request's arrival to its answer's end",
                                  ["endpoint"], buckets=_LATENCY, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
