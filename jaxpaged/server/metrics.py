"""Prometheus metrics of the server, with vLLM's names, in a registry of their own.

Gauges and engine counters are read from `AsyncEngine.stats` at each scrape (the engine's
own cumulative counts, exposed as counters: prometheus_client adds `_total`, as vLLM's do).
Latency histograms are observed on the engine thread as outputs leave it:

    vllm:time_to_first_token_seconds   arrival -> first generated token
    vllm:inter_token_latency_seconds   between a request's consecutive tokens (an output of several spreads its time)
    vllm:e2e_request_latency_seconds   arrival -> finished (aborted requests excluded)
"""

import itertools
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxpaged.core.speculation import SPEC_DECODE_PER_POSITION
from jaxpaged.outputs import RequestOutput
from jaxpaged.server.data_parallel import EngineClient

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)

# (metric name, kind, stats key, help)
_FROM_STATS = (
    ("vllm:num_requests_running", "gauge", "num_running", "Sequences in the running batch."),
    ("vllm:num_requests_waiting", "gauge", "num_waiting", "Sequences waiting to be scheduled."),
    ("vllm:kv_cache_usage_perc", "gauge", "gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent."),
    ("vllm:prefix_cache_queries", "counter", "prefix_cache_queries", "Prefix-cache lookups, in tokens."),
    ("vllm:prefix_cache_hits", "counter", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("vllm:num_preemptions", "counter", "num_preemptions", "Preemptions by the scheduler."),
    ("vllm:prompt_tokens", "counter", "prompt_tokens", "Prompt tokens received."),
    ("vllm:generation_tokens", "counter", "generation_tokens", "Tokens generated."),
    # With a host tier (--kv-offloading-size) only: its prefix hits under vLLM's names for a KV
    # cache beyond the device, and its traffic under jaxpaged's.
    (
        "vllm:external_prefix_cache_queries",
        "counter",
        "external_prefix_cache_queries",
        "Prefix-cache lookups that could hit the host tier, in tokens.",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "counter",
        "external_prefix_cache_hits",
        "Prefix-cache hits served from the host tier, in tokens.",
    ),
    ("jaxpaged:kv_host_tier_blocks", "gauge", "kv_host_tier_blocks", "Blocks the host tier holds at most."),
    (
        "jaxpaged:kv_host_tier_cached_blocks",
        "gauge",
        "kv_host_tier_cached_blocks",
        "Host-tier blocks holding evicted prefix-cache blocks.",
    ),
    (
        "jaxpaged:kv_host_tier_swapped_blocks",
        "gauge",
        "kv_host_tier_swapped_blocks",
        "Host-tier blocks holding preempted sequences' blocks.",
    ),
    ("jaxpaged:kv_offload_bytes", "counter", "kv_offload_bytes", "KV bytes copied from the devices to the host tier."),
    ("jaxpaged:kv_load_bytes", "counter", "kv_load_bytes", "KV bytes copied from the host tier to the devices."),
    (
        "jaxpaged:kv_swapped_out_blocks",
        "counter",
        "kv_swapped_out_blocks",
        "Blocks of preempted sequences swapped out.",
    ),
    ("jaxpaged:kv_swapped_in_blocks", "counter", "kv_swapped_in_blocks", "Blocks of resumed sequences swapped in."),
    # With a disk tier (--kv-cache-dir) only.
    ("jaxpaged:kv_disk_hit_tokens", "counter", "kv_disk_hit_tokens", "Prefix tokens read back from the disk tier."),
    ("jaxpaged:kv_disk_read_bytes", "counter", "kv_disk_read_bytes", "KV bytes read from the disk tier."),
    ("jaxpaged:kv_disk_write_bytes", "counter", "kv_disk_write_bytes", "KV bytes written to the disk tier."),
    ("jaxpaged:kv_disk_blocks", "gauge", "kv_disk_blocks", "Blocks the disk tier holds."),
    (
        "jaxpaged:kv_disk_rejected_files",
        "counter",
        "kv_disk_rejected_files",
        "Disk-tier files found truncated, corrupt or of another model, and removed.",
    ),
    (
        "jaxpaged:kv_disk_dropped_writes",
        "counter",
        "kv_disk_dropped_writes",
        "Disk-tier writes skipped because too many were pending.",
    ),
    # One device's memory by use (`LLMEngine.device_memory_stats`).
    ("jaxpaged:device_weight_bytes", "gauge", "device_weight_bytes", "Weight bytes on the fullest device."),
    ("jaxpaged:kv_cache_bytes", "gauge", "kv_cache_bytes", "Bytes of one device's KV pool."),
    ("jaxpaged:kv_cache_used_bytes", "gauge", "kv_cache_used_bytes", "Bytes of one device's KV pool in use."),
    (
        "jaxpaged:step_temp_bytes",
        "gauge",
        "step_temp_bytes",
        "Temporaries of the largest compiled step program on one device (XLA's memory analysis).",
    ),
    # With a tokenizer (structured outputs) only; the compile times: _GRAMMAR_COMPILE_SECONDS.
    ("jaxpaged:grammar_compiles", "counter", "grammar_compiles", "Grammars compiled (failed compiles too)."),
    (
        "jaxpaged:grammar_cache_hits",
        "counter",
        "grammar_cache_hits",
        "Constraints whose compiled grammar (or compile error) came from the cache.",
    ),
    # With a speculative_config only.
    ("vllm:spec_decode_num_drafts", "counter", "spec_decode_num_drafts", "Proposal windows checked."),
    ("vllm:spec_decode_num_draft_tokens", "counter", "spec_decode_num_draft_tokens", "Proposed tokens checked."),
    ("vllm:spec_decode_num_accepted_tokens", "counter", "spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
)
_GRAMMAR_COMPILE_SECONDS = (
    "jaxpaged:grammar_compile_seconds",
    "grammar_compile_seconds",
    "Seconds each grammar took to compile (on the engine's grammar threads).",
)
_PER_POSITION = (
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    SPEC_DECODE_PER_POSITION,
    "Proposed tokens accepted, by position in the proposal window.",
)


class _EngineStatsCollector:
    """Reads the engine's latest stats snapshot at every scrape."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.stats
        for name, kind, key, doc in _FROM_STATS:
            if key not in stats:  # e.g. the host tier's, without one
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family
        name, key, doc = _GRAMMAR_COMPILE_SECONDS
        if key in stats:
            bounds, counts, total = stats[key]
            cumulative = list(itertools.accumulate(counts))
            buckets = [(repr(float(b)), c) for b, c in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], buckets, sum_value=total)
            yield family
        if "lora_requests_info" in stats:  # vLLM's: its labels say which adapters run and wait
            info = stats["lora_requests_info"]
            family = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running and waiting LoRA adapters (labels); the value is when they were read.",
                labels=list(info),
            )
            family.add_metric(list(info.values()), time.time())
            yield family
        name, key, doc = _PER_POSITION
        if key in stats:
            family = CounterMetricFamily(name, doc, labels=["model_name", "position"])
            for position, count in enumerate(stats[key]):
                family.add_metric([self.model_name, str(position)], float(count))
            yield family


class ServerMetrics:
    """The server's metrics; registers itself as an output observer of `engine`.

    Args:
      engine: the async engine whose outputs and stats are measured.
      model_name: the `model_name` label (the served model name).
    """

    def __init__(self, engine: EngineClient, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine, model_name))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry).labels(
                model_name
            )

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Inter-token latency, seconds.")
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self._last_token_time: dict[str, float] = {}  # engine thread only
        engine.output_observers.append(self.observe)

    def observe(self, output: RequestOutput, now: float) -> None:
        """Records one (delta) output; runs on the engine thread."""
        new_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        arrival = output.metrics.arrival_time if output.metrics else now
        last = self._last_token_time.get(output.request_id)
        if new_tokens:
            if last is None:
                first = (output.metrics.first_token_time if output.metrics else None) or now
                self.time_to_first_token.observe(max(first - arrival, 0.0))
                # the tokens after the first in the same output (a request answered when done, or
                # accepted proposals) came between the first token and now
                last, new_tokens = first, new_tokens - 1
            for _ in range(new_tokens):  # fused decode steps deliver several tokens at once
                self.inter_token_latency.observe(max(now - last, 0.0) / new_tokens)
            self._last_token_time[output.request_id] = now
        if output.finished:
            self._last_token_time.pop(output.request_id, None)
            reasons = {c.finish_reason for c in output.outputs}
            reason = "abort" if "abort" in reasons else "stop" if "stop" in reasons else "length"
            self._success.labels(self._model_name, reason).inc()
            if reason != "abort":
                self.e2e_request_latency.observe(max(now - arrival, 0.0))

    def render(self) -> tuple[bytes, str]:
        """`(body, content type)` of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
