"""`/metrics`: the server's Prometheus metrics, in a registry of each app's own (two apps in one process, as in the
tests or Ray replicas sharing a worker, do not mix their counts).

Names follow Prometheus' conventions (`_total` counters, `_seconds` histograms) under the `vaswani_` prefix:

- `vaswani_requests_total{route, status}`: HTTP requests answered, by route (the path; "other" for an unknown one, so
  a scanner cannot grow the label set) and status code.
- `vaswani_running_sequences`, `vaswani_prefilling_sequences`, `vaswani_waiting_sequences`: the scheduler's queues, read
  at each scrape; `vaswani_engine_alive`: 1 while the engine thread runs (0 after it died: `/health` is 503).
- `vaswani_time_to_first_token_seconds`: from a request's arrival to each choice's first token.
- `vaswani_inter_token_latency_seconds`: between two tokens of a choice, as its client receives them.
- `vaswani_prompt_tokens_total`, `vaswani_generation_tokens_total`: tokens in and out.
- `vaswani_batch_size`: the running sequences of each decoding step.
- `vaswani_constrained_requests_total{field}`: requests whose answer was held to a constraint, by the field that
  carried it (`response_format`, `structured_outputs`, `guided_json`, ..., `tool_choice`).
- `vaswani_grammar_compile_seconds`: compiling a request's constraint (a grammar seen before comes from the cache).
- `vaswani_tool_calls_total`: tool calls returned to clients.
- `vaswani_prefix_cache_queries_total`, `vaswani_prefix_cache_hits_total`: prompt tokens looked up in the prefix cache
  and found there (vLLM's pair: the hit rate is their ratio); `vaswani_prefix_cache_bytes`: the keys and values it
  holds; `vaswani_prefix_cache_evictions_total`: blocks evicted under its budget. Present where the cache is on.
- With speculative decoding (`speculation`), vLLM's counters: `vaswani_spec_decode_num_drafts_total` (rows that got
  proposals, per step), `vaswani_spec_decode_num_draft_tokens_total` (tokens proposed) and
  `vaswani_spec_decode_num_accepted_tokens_total` (proposals kept); the acceptance rate is accepted / proposed.

    >>> metrics = ServerMetrics(service)
    >>> metrics.render()  # the text format, for GET /metrics
"""

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .speculation import SpeculationCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: first tokens wait for a prefill (and maybe a queue), later ones for one decoding step of the batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
GRAMMAR_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The Prometheus metrics of one app; `service` is read at each scrape for the scheduler's gauges."""

    def __init__(self, service: Any):
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "vaswani_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter("vaswani_prompt_tokens", "Prompt tokens of accepted requests.", registry=registry)
        self.generation_tokens = Counter("vaswani_generation_tokens", "Tokens generated.", registry=registry)
        self.time_to_first_token = Histogram(
            "vaswani_time_to_first_token_seconds",
            "Seconds from a request's arrival to a choice's first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "vaswani_inter_token_latency_seconds",
            "Seconds between two consecutive tokens of a choice.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "vaswani_batch_size", "Running sequences per decoding step.", buckets=BATCH_BUCKETS, registry=registry
        )
        self.constrained_requests = Counter(
            "vaswani_constrained_requests",
            "Requests whose answer was held to a constraint, by the request field that carried it.",
            ["field"],
            registry=registry,
        )
        self.grammar_compile = Histogram(
            "vaswani_grammar_compile_seconds",
            "Seconds to compile a request's constraint (cached grammars take microseconds).",
            buckets=GRAMMAR_BUCKETS,
            registry=registry,
        )
        self.tool_calls = Counter("vaswani_tool_calls", "Tool calls returned.", registry=registry)
        scheduler = service.scheduler
        if scheduler is not None:
            for name, key in (("running", "running"), ("prefilling", "prefilling"), ("waiting", "waiting")):
                gauge = Gauge(f"vaswani_{name}_sequences", f"Sequences {name} in the scheduler.", registry=registry)
                gauge.set_function(lambda key=key: scheduler.stats()[key])
            alive = Gauge("vaswani_engine_alive", "1 while the engine thread runs, else 0.", registry=registry)
            alive.set_function(lambda: float(scheduler.alive))
            scheduler.step_listeners.append(self.batch_size.observe)
            if scheduler.prefix_cache is not None:
                registry.register(PrefixCacheCollector(scheduler.prefix_cache))
            if scheduler.speculator is not None:
                registry.register(SpeculationCollector(scheduler.speculator))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """The prefix cache's counts, read at each scrape (the scheduler thread keeps them; a counter of our own would
    need a second count kept beside them)."""

    def __init__(self, cache: Any):
        self.cache = cache

    def describe(self):
        return []  # the families are known only at collection; the registry then checks nothing up front

    def collect(self):
        cache = self.cache
        for name, text, value in (
            ("queries", "Prompt tokens looked up in the prefix cache.", cache.queried_tokens),
            ("hits", "Prompt tokens found in the prefix cache (computed no more).", cache.hit_tokens),
            ("evictions", "Blocks evicted from the prefix cache under its byte budget.", cache.evicted_blocks),
        ):
            yield CounterMetricFamily(f"vaswani_prefix_cache_{name}", text, value=value)
        yield GaugeMetricFamily("vaswani_prefix_cache_bytes", "Bytes of keys and values held.", value=cache.bytes)
