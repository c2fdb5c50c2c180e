"""Prometheus metrics (GET /metrics), in a registry of the app's own so that several apps can
live in one process (tests).

Engine gauges and counters are read from the snapshot the engine thread publishes after every
step (EngineStats), so a scrape never touches the engine. Latency histograms use the engine's
own timestamps: time to first token, end-to-end and queue time are measured from the moment
the engine accepted the request; inter-token latency is the gap between successive steps that
gave the request tokens.
"""
from __future__ import annotations

from typing import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ridge.engine.engine import EngineStats
from ridge.engine.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
        0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)


# The gauges a gateway's endpoint picker reads, under vLLM's names (the Kubernetes Gateway API
# Inference Extension's model-server protocol: queue length and KV-cache utilisation), labelled with
# the served model's name as vLLM labels them; beside ridge's own names, which say the same.
GATEWAY_GAUGES = (("vllm:num_requests_waiting", "requests waiting (the gateway's TotalQueuedRequests)", "num_waiting"),
                  ("vllm:num_requests_running", "requests running (the gateway's TotalRunningRequests)", "num_running"),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full (the gateway's KVCacheUtilization)",
                   "kv_cache_usage"),
                  ("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (vLLM's earlier name)", "kv_cache_usage"))


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats | None], healthy: Callable[[], bool],
                 model_name: Callable[[], str]):
        self._stats, self._healthy, self._model_name = stats, healthy, model_name

    def _of_model(self, kind, name: str, text: str, value: float):
        """A vLLM-named family, labelled with the served model's name as vLLM labels its metrics."""
        family = kind(name, text, labels=["model_name"])
        family.add_metric([self._model_name()], value)
        return family

    def collect(self):
        yield GaugeMetricFamily("ridge_engine_healthy", "1 when the engine is ready to serve, else 0",
                                value=1.0 if self._healthy() else 0.0)
        st = self._stats()
        if st is None:
            return
        for name, text, field in GATEWAY_GAUGES:
            yield self._of_model(GaugeMetricFamily, name, text, getattr(st, field))
        # prompt tokens looked up in the prefix cache and found there: ridge's names and vLLM's
        for ridge_name, vllm_name, text, value in (
                ("ridge_prefix_cache_queries", "vllm:prefix_cache_queries",
                 "prompt tokens looked up in the prefix cache", st.prefix_cache_queries),
                ("ridge_prefix_cache_hits", "vllm:prefix_cache_hits",
                 "prompt tokens found in the prefix cache (not computed)", st.prefix_cache_hits)):
            yield CounterMetricFamily(ridge_name, text, value=value)
            yield self._of_model(CounterMetricFamily, vllm_name, text, value)
        yield GaugeMetricFamily("ridge_num_requests_running",
                                "sequences in the running batch (a request with n samples counts n)",
                                value=st.num_running)
        yield GaugeMetricFamily("ridge_num_requests_waiting", "sequences waiting to be scheduled",
                                value=st.num_waiting)
        yield GaugeMetricFamily("ridge_kv_cache_usage_ratio",
                                "fraction of KV pages held by sequences (prefix-cached free pages count as free)",
                                value=st.kv_cache_usage)
        yield GaugeMetricFamily("ridge_kv_cache_pages", "KV pages in the pool", value=st.num_pages)
        yield GaugeMetricFamily("ridge_kv_cache_free_pages", "KV pages not held by any sequence",
                                value=st.num_free_pages)
        yield CounterMetricFamily("ridge_num_preemptions", "sequences preempted for lack of KV pages",
                                  value=st.num_preemptions)
        yield CounterMetricFamily("ridge_prompt_tokens", "prompt tokens computed (prefix-cache hits excluded)",
                                  value=st.prompt_tokens)
        yield CounterMetricFamily("ridge_generation_tokens", "tokens generated", value=st.generation_tokens)
        yield CounterMetricFamily("ridge_decode_steps", "decode steps served by the static (CUDA-graph) path",
                                  value=st.num_decode_steps)
        yield CounterMetricFamily("ridge_overlapped_decode_steps",
                                  "decode steps launched before the previous step's ids were read back",
                                  value=st.num_overlapped_steps)
        yield GaugeMetricFamily("ridge_decode_overlap_ratio", "overlapped / decode steps since start (0 before any)",
                                value=st.overlap_fraction or 0.0)
        if torch.cuda.is_initialized():         # this process's device: rank 0's under tensor parallelism
            yield GaugeMetricFamily("ridge_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated: tensors alive",
                                    value=torch.cuda.memory_allocated())
            yield GaugeMetricFamily("ridge_gpu_memory_reserved_bytes",
                                    "torch.cuda.memory_reserved: held by the caching allocator",
                                    value=torch.cuda.memory_reserved())
        # speculative decoding, vLLM's names (vllm:spec_decode_*) under the proposer's method; none
        # without a speculative_config
        if not st.spec_method:
            return
        for name, text, value in (("num_drafts", "verify steps of a sequence with drafts", st.spec_num_drafts),
                                  ("num_draft_tokens", "draft tokens proposed", st.spec_num_draft_tokens),
                                  ("num_accepted_tokens", "draft tokens the target accepted",
                                   st.spec_num_accepted_tokens),
                                  ("propose_seconds", "host time in the proposer (its draft cost)",
                                   st.spec_propose_seconds)):
            family = CounterMetricFamily(f"ridge_spec_decode_{name}", text, labels=["method"])
            family.add_metric([st.spec_method], value)
            yield family
        per_pos = CounterMetricFamily("ridge_spec_decode_num_accepted_tokens_per_pos",
                                      "verify steps that accepted the draft at this position", labels=["method", "position"])
        for i, n in enumerate(st.spec_accepted_per_pos):
            per_pos.add_metric([st.spec_method, str(i)], n)
        yield per_pos


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None], healthy: Callable[[], bool],
                 model_name: Callable[[], str] = lambda: ""):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, healthy, model_name))
        r = self.registry
        self.ttft = Histogram("ridge_time_to_first_token_seconds", "time to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("ridge_inter_token_latency_seconds", "time between two steps that gave a request tokens",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("ridge_e2e_request_latency_seconds", "end-to-end request latency", buckets=_E2E,
                             registry=r)
        self.queue = Histogram("ridge_request_queue_time_seconds", "time from arrival to first scheduled",
                               buckets=_LATENCY, registry=r)
        self.finished = Counter("ridge_request_finished", "engine requests finished, by reason "
                                "(stop, length; abort: the client went away; error: the engine failed)",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("ridge_http_request_errors", "HTTP requests answered with an error, by status",
                                ["status"], registry=r)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.finished_time is not None:
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.e2e.observe(m.finished_time - m.arrival_time)
        reasons = {o.finish_reason for o in out.outputs}
        self.finished.labels("length" if "length" in reasons else "stop").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
