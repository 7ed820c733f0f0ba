"""The engine's adapters: loaded on first use, kept up to ``max_cpu_loras`` (least recently used out),
and each step's LoRAStep built from the rows of its requests.

A request names its adapter (``SamplingParams.lora_name``, checked against the registry at the door);
``require`` loads it when the request is added, so a folder that cannot be served fails that request
alone, with the reason. The scheduler admits at most ``max_loras`` distinct adapters into the running
batch (backend/engine/scheduler.py); the adapters of running requests are never evicted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.config import LoRAConfig
from backend.kv_cache.block_pool import BlockHash
from backend.lora.adapter import LoRAAdapter, load_adapter
from backend.lora.registry import AdapterRegistry, LoRAConfigError, read_registry
from backend.lora.slots import LoRASlots
from backend.lora.step import LoRAStep, segments_of
from backend.models.shape import ModelShape

logger = logging.getLogger(__name__)

# checkpoints whose adapters name separate q/k/v/gate/up projections of a dense MLP (peft's layout)
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(slots=True)
class LoRAStats:
    loads: int = 0
    load_seconds: list[float] = field(default_factory=list)  # not reported yet
    requests: Counter = field(default_factory=Counter)  # adapter name -> requests added


def root_hash(adapter: LoRAAdapter) -> BlockHash:
    """What a request's first KV block chains to under ``adapter``: its name and weights digest, so
    blocks of two adapters (or of an adapter and the base model, whose first block chains to nothing)
    never match, in the pool, the offload tiers or a transfer."""
    return BlockHash(hash(("lora", adapter.name, adapter.digest)))


class LoRAManager:
    def __init__(self, config: LoRAConfig, shape: ModelShape, dtype: torch.dtype, device: torch.device,
                 live: Callable[[], set[str | None]], registry: AdapterRegistry | None = None,
                 shard=None, local_shape: ModelShape | None = None) -> None:
        """``live()``: the adapters of the requests the engine holds (never evicted); ``shape`` is the
        whole model's; a tensor-parallel rank's ``shard`` and ``local_shape`` keep its part of each adapter."""
        self.config = config
        self.shape, self.dtype, self.device = shape, dtype, device
        self.shard, self.local_shape = shard, local_shape
        self.slots = LoRASlots(config.max_loras, config.max_lora_rank, dtype, device)  # the decodes' batched path
        self.registry = registry if registry is not None else read_registry(config.lora_adapters)
        self.live = live
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.stats = LoRAStats()
        self._lock = threading.Lock()  # stats are read from the stats thread

    def require(self, name: str) -> LoRAAdapter:
        """The loaded adapter ``name`` (loading it now if needed); LoRAConfigError naming the reason
        when it cannot be served."""
        adapter = self.loaded.get(name)
        if adapter is None:
            entry = self.registry.by_name.get(name)
            if entry is None:
                raise LoRAConfigError(f"lora_name: {name!r} is not an adapter of this model")
            start = time.perf_counter()
            adapter = load_adapter(entry, self.shape, self.config.max_lora_rank, self.dtype, self.device,
                                   self.shard, self.local_shape)
            seconds = time.perf_counter() - start
            with self._lock:
                self.stats.loads += 1
                self.stats.load_seconds.append(seconds)
            logger.info("LoRA adapter %s loaded (rank %d, %.1f MiB) in %.3f s", name, adapter.rank,
                        adapter.nbytes / 2**20, seconds)
            self.loaded[name] = adapter
        self.loaded.move_to_end(name)
        with self._lock:
            self.stats.requests[name] += 1
        self._evict(keep=name)
        return adapter

    def _evict(self, keep: str) -> None:
        """Least recently used adapters out beyond max_cpu_loras, never one a live request uses."""
        if len(self.loaded) <= self.config.max_cpu_loras:
            return
        live = self.live() | {keep}
        for name in list(self.loaded):
            if len(self.loaded) <= self.config.max_cpu_loras:
                return
            if name not in live:
                del self.loaded[name]

    def step_for(self, row_adapters: list[str | None], num_decodes: int = 0) -> LoRAStep | None:
        """The step's LoRAStep from each row's adapter (None: the base model; the first
        ``num_decodes`` rows are decodes); None without adapters."""
        decodes = segments_of(row_adapters[:num_decodes])  # one run per adapter: rows are sorted by adapter
        runs = segments_of(row_adapters[num_decodes:], offset=num_decodes)
        if not decodes and not runs:
            return None
        step = LoRAStep()
        if len(decodes) >= 2 or (decodes and self.slots.has_kernel):
            names = list(decodes)
            step.slots = self.slots
            step.decode_plan = self.slots.plan([self.loaded[name] for name in names],
                                               [decodes[name][0] for name in names])
        else:
            for name, segments in decodes.items():
                runs.setdefault(name, []).extend(segments)
        step.groups = [(self.loaded[name], segments) for name, segments in runs.items()]
        return step

    def engine_stats_fields(self, running: set[str | None], waiting: set[str | None]) -> dict:
        """This manager's part of EngineStats, with the adapters of running and waiting requests."""
        with self._lock:
            seconds, self.stats.load_seconds = self.stats.load_seconds, []
            return {"lora_loads": self.stats.loads, "lora_load_seconds": seconds,
                    "lora_requests": dict(self.stats.requests), "lora_loaded": len(self.loaded),
                    "lora_running": sorted(running - {None}), "lora_waiting": sorted(waiting - {None}),
                    "lora_max": self.config.max_loras}
