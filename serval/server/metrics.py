"""Prometheus metrics, named in vLLM's style (``serval:...``), one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serval.engine.client import EngineClient

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0)


# Disaggregated prefill/decode (engine/kv_transfer.py): (family, name after serval:kv_transfer_, help, stats field).
_KV_TRANSFER_METRICS = (
    (GaugeMetricFamily, "held_blocks", "KV blocks a prefill worker holds for decode workers.", "kv_held_blocks"),
    (CounterMetricFamily, "sent_blocks", "KV blocks sent to decode workers.", "kv_sent_blocks"),
    (CounterMetricFamily, "sent_early_blocks", "KV blocks sent while their prompt's prefill still computed "
     "(the transfer overlapping the compute).", "kv_sent_early_blocks"),
    (CounterMetricFamily, "sent_bytes", "Bytes of KV sent to decode workers.", "kv_sent_bytes"),
    (CounterMetricFamily, "received_blocks", "KV blocks fetched from prefill workers.", "kv_received_blocks"),
    (CounterMetricFamily, "received_bytes", "Bytes of KV fetched from prefill workers.", "kv_received_bytes"),
    (CounterMetricFamily, "expired_holds", "Held prompts no decode worker fetched in time (their blocks freed).",
     "kv_expired_holds"),
    (CounterMetricFamily, "failed_fetches", "Fetches that failed; those prompts were computed on the decode worker.",
     "kv_failed_fetches"),
    (CounterMetricFamily, "fetches", "Fetches of a prompt's KV that brought it.", "kv_fetches"),
    (CounterMetricFamily, "fetch_seconds", "Time those fetches took, asked to last block "
     "received (with a router, the prefill computes meanwhile).",
     "kv_fetch_seconds"),
)


class _EngineCollector:
    """Reads the engine's live state at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.snapshot()
        yield GaugeMetricFamily("serval:num_requests_running", "Requests in the running batch.", s.num_running)
        yield GaugeMetricFamily("serval:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily("serval:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                                s.kv_cache_usage)
        yield GaugeMetricFamily("serval:kv_cache_blocks_owned", "KV blocks owned by live requests.",
                                s.num_blocks - s.num_free_blocks)
        yield GaugeMetricFamily("serval:kv_cache_blocks_total", "KV blocks in the cache.", s.num_blocks)
        yield CounterMetricFamily("serval:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queried_tokens)
        yield CounterMetricFamily("serval:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s.prefix_cache_hit_tokens)
        yield CounterMetricFamily("serval:num_preemptions", "Requests preempted for lack of KV blocks.",
                                  s.num_preemptions)
        yield CounterMetricFamily("serval:num_swapped_preemptions",
                                  "Preemptions that swapped the request's KV to the second tier (not recomputed).",
                                  s.num_swaps)
        yield CounterMetricFamily("serval:kv_offload_saved_blocks", "KV blocks written to the second tier.",
                                  s.offload_saved_blocks)
        yield CounterMetricFamily("serval:kv_offload_loaded_blocks", "KV blocks read back from the second tier.",
                                  s.offload_loaded_blocks)
        yield CounterMetricFamily("serval:kv_offload_hits", "Prompt tokens found in the second tier.",
                                  s.offload_hit_tokens)
        yield GaugeMetricFamily("serval:kv_offload_blocks_cached", "Prefix blocks the second tier holds.",
                                s.offload_cached_blocks)
        yield GaugeMetricFamily("serval:kv_offload_blocks_swapped", "Blocks of swapped-out requests.",
                                s.offload_swapped_blocks)
        yield GaugeMetricFamily("serval:kv_offload_blocks_total", "Blocks the second tier holds at most (0: none).",
                                s.offload_blocks)
        yield CounterMetricFamily("serval:session_cache_requests",
                                  "Requests that continued a conversation whose KV was kept.", s.session_requests)
        yield CounterMetricFamily("serval:session_cache_hits",
                                  "Prompt tokens those requests found cached (not computed again).",
                                  s.session_hit_tokens)
        yield GaugeMetricFamily("serval:session_cache_sessions", "Conversations whose KV is kept.", s.num_sessions)
        yield GaugeMetricFamily("serval:session_cache_blocks", "KV blocks kept for conversations.", s.session_blocks)
        yield CounterMetricFamily("serval:spec_decode_num_drafts", "Steps that checked a request's guessed tokens.",
                                  s.spec_num_drafts)
        yield CounterMetricFamily("serval:spec_decode_num_draft_tokens", "Guessed tokens checked.",
                                  s.spec_num_draft_tokens)
        yield CounterMetricFamily("serval:spec_decode_num_accepted_tokens", "Guessed tokens accepted.",
                                  s.spec_num_accepted_tokens)
        per_position = CounterMetricFamily("serval:spec_decode_num_accepted_tokens_per_pos",
                                           "Guessed tokens accepted, by position in the guess (0 = first).",
                                           labels=["position"])
        for position, count in enumerate(s.spec_accepted_per_position):
            per_position.add_metric([str(position)], count)
        yield per_position
        for family, name, documentation, attribute in _KV_TRANSFER_METRICS:
            yield family(f"serval:kv_transfer_{name}", documentation, getattr(s, attribute))
        yield GaugeMetricFamily("serval:engine_alive", "1 while the engine loop runs.", int(self.engine.is_alive))


class ServerMetrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Streamed or not, a request of one prompt and n choices of T tokens each observes n TTFTs, n * (T - 1)
        # inter-token latencies and one end-to-end latency (a completions call with several prompts: one each).
        self.ttft = Histogram("serval:time_to_first_token_seconds", "Time to first token, per choice.", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("serval:inter_token_latency_seconds", "Time between a choice's tokens.", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("serval:e2e_request_latency_seconds", "Request latency, arrival to last token, per "
                             "prompt.", registry=r, buckets=_LATENCY_BUCKETS)
        self.queue_time = Histogram("serval:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("serval:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("serval:generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter("serval:request_success", "Finished requests by reason.",
                                       ["finished_reason"], registry=r)
        self.http_errors = Counter("serval:http_errors", "Error responses by status.", ["status"], registry=r)
        r.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
