"""The load metrics a cluster scheduler reads, under the names it knows, beside our own llm_* ones.

llm-d's endpoint picker and vLLM's production stack scrape vLLM's names; Triton deployments of
TensorRT-LLM expose the TensorRT-LLM backend's. Both are set from the same engine statistics as
``llm_num_requests_waiting``, ``llm_num_requests_running`` and ``llm_kv_cache_usage_ratio``
(backend/triton/metrics.py), so a scheduler written for either engine type reads this model:

- vLLM: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
  (a fraction, 1 = full, as vLLM's) with label ``model_name``, and ``vllm:cache_config_info`` (value 1)
  whose labels ``block_size`` and ``num_gpu_blocks`` describe the KV pool;
- with LoRA adapters, vLLM's ``vllm:lora_requests_info`` (value: the time it was set, as vLLM's)
  whose labels ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated) and
  ``max_lora`` say which adapters are in use: the adapter-locality signal of LoRA-aware routers;
- TensorRT-LLM: ``nv_trt_llm_request_metrics{request_type="waiting"|"scheduled"|"active"|"max"}``
  and ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"|"used"|"free"|"tokens_per"|"fraction"}``,
  labelled ``model`` and ``version``.
"""

from __future__ import annotations

import time

from backend.protocol.outputs import EngineStats

REQUEST_TYPES = ("waiting", "scheduled", "active", "max")
BLOCK_TYPES = ("max", "used", "free", "tokens_per", "fraction")


class LoadMetrics:
    def __init__(self, pb_utils, model_name: str, version: str, block_size: int, max_num_seqs: int):
        family = pb_utils.MetricFamily
        gauge = family.GAUGE
        self._block_size, self._max_num_seqs = block_size, max_num_seqs
        self._families = [
            family(name="vllm:num_requests_waiting", description="Requests waiting to be scheduled", kind=gauge),
            family(name="vllm:num_requests_running", description="Requests in the running batch", kind=gauge),
            family(name="vllm:kv_cache_usage_perc", description="KV-cache usage; 1 means 100 percent", kind=gauge),
            family(name="vllm:cache_config_info", description="Information of the KV cache configuration",
                   kind=gauge),
            family(name="nv_trt_llm_request_metrics", description="Requests by state (TensorRT-LLM's names)",
                   kind=gauge),
            family(name="nv_trt_llm_kv_cache_block_metrics", description="KV-cache blocks (TensorRT-LLM's names)",
                   kind=gauge),
            family(name="vllm:lora_requests_info", description="Running and waiting LoRA adapters (vLLM's)",
                   kind=gauge),
        ]
        waiting, running, usage, self._info_family, requests, blocks, self._lora_family = self._families
        self._lora_info: dict[tuple[str, str], object] = {}  # (running, waiting) -> its metric
        self._lora_last: tuple[str, str] | None = None
        vllm_labels = {"model_name": model_name}
        self.waiting, self.running, self.usage = (f.Metric(labels=vllm_labels) for f in (waiting, running, usage))
        self._vllm_labels = vllm_labels
        self._info = None  # made once the pool's size is known
        trt_labels = {"model": model_name, "version": version or "1"}
        self.requests = {kind: requests.Metric(labels=dict(trt_labels, request_type=kind)) for kind in REQUEST_TYPES}
        self.blocks = {kind: blocks.Metric(labels=dict(trt_labels, kv_cache_block_type=kind)) for kind in BLOCK_TYPES}
        self._sent: dict[int, float] = {}  # id(metric) -> the value last set
        self.requests["max"].set(max_num_seqs)
        self.blocks["tokens_per"].set(block_size)

    def update(self, stats: EngineStats) -> None:
        """Sets the gauges from one step's statistics; only those whose value changed (each set is a
        round trip from the stub to tritonserver, and most steps change only the KV usage)."""
        usable = max(stats.num_kv_blocks - 1, 0)  # block 0 is the null block
        used = round(stats.kv_cache_usage * usable)
        for metric, value in (
            (self.waiting, stats.num_waiting), (self.running, stats.num_running), (self.usage, stats.kv_cache_usage),
            (self.requests["waiting"], stats.num_waiting), (self.requests["scheduled"], stats.num_running),
            (self.requests["active"], stats.num_running + stats.num_waiting), (self.blocks["max"], usable),
            (self.blocks["used"], used), (self.blocks["free"], usable - used),
            (self.blocks["fraction"], stats.kv_cache_usage),
        ):
            if self._sent.get(id(metric)) != value:
                self._sent[id(metric)] = value
                metric.set(value)
        if stats.lora_max:
            self._update_lora(stats)
        if self._info is None and stats.num_kv_blocks:
            self._info = self._info_family.Metric(labels=dict(
                self._vllm_labels, block_size=str(self._block_size), num_gpu_blocks=str(stats.num_kv_blocks)))
            self._info.set(1)

    def _update_lora(self, stats: EngineStats) -> None:
        """A new ``vllm:lora_requests_info`` sample when the running or waiting adapters changed."""
        key = (",".join(stats.lora_running), ",".join(stats.lora_waiting))
        if key == self._lora_last:
            return
        self._lora_last = key
        metric = self._lora_info.get(key)
        if metric is None:
            metric = self._lora_info[key] = self._lora_family.Metric(labels=dict(
                self._vllm_labels, running_lora_adapters=key[0], waiting_lora_adapters=key[1],
                max_lora=str(stats.lora_max)))
        metric.set(time.time())

    def close(self) -> None:
        self._lora_info.clear()
        self.requests.clear()
        self.blocks.clear()
        self._families.clear()
