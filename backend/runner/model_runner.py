"""The model runner: owns the model and its paged KV cache, and runs one scheduled step at a time.

``ModelRunner.load`` does everything between a config and a runnable model, as nano-vllm's runner
does: the device, the dtype, the attention backend, loading the weights, sizing the KV cache
(``num_kv_blocks``, else ``kv_cache_memory_mb``, else from free memory) and allocating it (one
``(key_cache, value_cache)`` pair per layer). The engine only learns the block count.

A step: the runner builds the flattened batch (``input_ids``, ``positions``, ``slot_mapping``,
``block_tables``, ``seq_lens``, ``query_start_loc``) with numpy vector ops (no per-token Python
loops), runs the forward, and computes logits only for requests whose scheduled chunk reaches
their last token (a finished prefill or a decode); a partial prefill chunk samples nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from backend.attention.base import AttentionMetadata
from backend.attention.selector import get_attention_backend
from backend.config import CacheConfig, ConfigError, ModelConfig
from backend.kv_cache.offload.block_io import PagedBlockIO
from backend.lora.cuda_bgmv import CudaBGMV
from backend.lora.step import LoRAHook
from backend.models.loader import ModelLoadError, load_config, load_model, resolve_dtype
from backend.models.shape import ModelShape, ceil_div
from backend.parallel import group
from backend.parallel.driver import TensorParallelDriver, WorkerStartError
from backend.parallel.shard import TensorShard, check_shardable, local_shape
from backend.runner.sampler import chosen_logprobs
from backend.runner.scheduled import RunnerRequest

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits exist at once (bounds the memory of [rows, vocab])


class ScheduledLike(Protocol):
    """What the runner reads of a scheduled request (backend/runner/scheduled.py ``ScheduledRequest``)."""

    request: RunnerRequest
    num_new_tokens: int
    num_computed_tokens: int  # snapshot before this step
    block_ids: list[int]  # the request's whole block table


def allocate_kv_caches(
    shape: ModelShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_size].

    Zeros matter: padded block-table entries point at block 0 and masked keys must stay finite.
    """
    size = (num_blocks, block_size, shape.num_kv_heads, shape.head_size)
    return [
        (torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device))
        for _ in range(shape.num_layers)
    ]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parameter 'device': cuda requested but torch sees no CUDA device")
    return torch.device(name)


def size_kv_cache(cache: CacheConfig, bytes_per_block: int, device: torch.device, max_num_seqs: int,
                  max_model_len: int) -> int:
    """num_kv_blocks, else kv_cache_memory_mb, else automatic (GPU: 85% of free; CPU: up to 2 GiB)."""
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_mb:
        budget = cache.kv_cache_memory_mb * 2**20
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * 0.85)
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(2 * 2**30, available // 4)
    # More blocks than every sequence at full length can use would only waste memory.
    useful = max_num_seqs * ceil_div(max_model_len, cache.block_size) + 1
    num_blocks = min(budget // bytes_per_block, useful)
    if num_blocks < 2:
        raise ConfigError("parameter 'kv_cache_memory_mb': too small for one KV block")
    return int(num_blocks)


_ALLOCATOR_TUNED = False


def tune_cpu_allocator() -> None:
    """Keeps glibc malloc from returning big buffers to the OS after every op (Linux, CPU only).

    Activations of a step are a few hundred KB to a few MB: above glibc's default mmap threshold
    each one is a fresh mmap whose pages fault in on first touch (~7-9k faults per decode step of
    a 30M model, ~30% of its time here). Raising the mmap and trim thresholds lets freed buffers be
    reused. Process-wide and idempotent; vLLM CPU gets the same effect by preloading tcmalloc.
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 64 << 20)
        libc.mallopt(m_trim_threshold, 256 << 20)
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        pass
    _ALLOCATOR_TUNED = True


def select_rows(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    rows: torch.Tensor | tuple[int, int] | None,  # index tensor [n] int64, a (start, end) slice, or None: all
) -> torch.Tensor:  # [n, hidden_size]
    """The rows of a forward's hidden states that get logits: what rank 0 scores and what it tells
    the other ranks of a tensor-parallel group to score (backend/runner/tp_worker.py)."""
    if rows is None:
        return hidden
    if isinstance(rows, tuple):
        return hidden[rows[0] : rows[1]]
    return hidden.index_select(0, rows)


class ModelRunner:
    """Runs the model over its paged KV cache for one scheduled step at a time."""

    def __init__(self, model, num_kv_blocks: int, block_size: int):
        """Binds ``model`` (a loaded LlamaForCausalLM) to a new zeroed KV cache of ``num_kv_blocks``."""
        parameter = next(model.parameters())
        self.model = model
        self.shape: ModelShape = model.shape
        self.device, self.dtype = parameter.device, parameter.dtype
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.kv_caches = allocate_kv_caches(self.shape, num_kv_blocks, block_size, self.dtype, self.device)
        self.vocab_size = self.shape.vocab_size
        self.prompt_logprobs: dict[int, tuple[int, list[float]]] = {}  # of the last execute(): see _prompt_logprobs
        self.lora = None  # backend/lora/manager.py LoRAManager, see attach_lora
        self.cpu_kernels = None  # the CPU kernel library when attention runs on it (load_rank)
        self.cupy_attention = None  # the CuPy attention backend on a GPU: its compile and launch serve LoRA too
        self._row_adapters: list[str | None] = []  # of the last prepare(): each row's adapter
        self.tensor_parallel = None  # rank 0 of a group: backend/parallel/driver.py, see load()
        self._pinned = None  # rank 0's affinity and thread count before the group pinned it

        self.block_io = PagedBlockIO(self.kv_caches)
        if self.device.type == "cpu":
            tune_cpu_allocator()

    def attach_lora(self, manager) -> None:
        """Serve LoRA adapters: each step's rows get their request's adapter's deltas."""
        self.lora = manager
        manager.slots.use_kernels(self.cpu_kernels)
        if self.cupy_attention is not None:
            manager.slots.use_cuda(CudaBGMV(self.dtype, self.cupy_attention.module_factory, self.cupy_attention.launch))
        self.lora_hook = LoRAHook()
        self.model.attach_lora(self.lora_hook)

    @classmethod
    def load(cls, model_config: ModelConfig, cache_config: CacheConfig, max_num_seqs: int,
             lora_config=None) -> ModelRunner:
        """Device, dtype, attention backend, weights, KV sizing and allocation from the config; with
        ``tensor_parallel_size`` > 1 this runner is rank 0 and starts the other ranks
        (backend/parallel/driver.py), each with its shard and the same KV block count (and, with
        ``lora_config``, its part of each adapter the steps use).

        Raises ConfigError naming the parameter when the model cannot be served as configured.
        """
        device = resolve_device(model_config.device)
        hf_config, dtype = cls._read_config(model_config, device)
        size = model_config.tensor_parallel_size
        shape = local_shape(ModelShape.of(hf_config), TensorShard(0, size))
        bytes_per_block = shape.kv_cache_bytes_per_block(cache_config.block_size, dtype)
        num_blocks = size_kv_cache(cache_config, bytes_per_block, device, max_num_seqs, model_config.max_model_len)
        if size == 1:
            return cls.load_rank(model_config, cache_config.block_size, num_blocks, TensorShard(), device,
                                 (hf_config, dtype))

        device = group.rank_device(device, 0)
        cores = sorted(os.sched_getaffinity(0))  # before rank 0 pins itself: every rank gets its own
        pinned = group.pin(0, cores) if device.type == "cpu" else None
        driver = None
        try:
            driver = TensorParallelDriver(model_config, cache_config.block_size, num_blocks, size, device, cores,
                                          lora_config)
            runner = cls.load_rank(model_config, cache_config.block_size, num_blocks, driver.shard, device,
                                   (hf_config, dtype))
            driver.wait_ready()
        except WorkerStartError as exc:
            cls._release(driver, pinned)
            raise ConfigError(f"parameter 'tensor_parallel_size': {exc}") from None
        except BaseException:
            cls._release(driver, pinned)
            raise
        runner.tensor_parallel, runner._pinned = driver, pinned
        return runner

    @staticmethod
    def _release(driver, pinned) -> None:
        if driver is not None:
            driver.close()
        if pinned is not None:
            group.unpin(pinned)

    @staticmethod
    def _read_config(model_config: ModelConfig, device: torch.device):
        """(the checkpoint's config, the dtype to run in); ConfigError naming the parameter."""
        if not os.path.isdir(model_config.model_dir):
            raise ConfigError(f"parameter 'model_dir': {model_config.model_dir} is not a folder")
        try:
            hf_config = load_config(model_config.model_dir, model_config.max_model_len)
        except ModelLoadError as exc:
            raise ConfigError(f"parameter 'model_dir': {exc}") from None
        try:
            check_shardable(hf_config, model_config.tensor_parallel_size)
        except ModelLoadError as exc:
            raise ConfigError(f"parameter 'tensor_parallel_size': {exc}") from None
        return hf_config, resolve_dtype(model_config.dtype, hf_config, device)

    @classmethod
    def load_rank(cls, model_config: ModelConfig, block_size: int, num_blocks: int, shard, device: torch.device,
                  config_and_dtype: tuple | None = None) -> ModelRunner:
        """One rank's runner: its shard of the weights (all of them alone) and ``num_blocks`` KV blocks.
        ``config_and_dtype``: what ``_read_config`` gave the caller already (a worker reads its own)."""
        hf_config, dtype = config_and_dtype or cls._read_config(model_config, device)
        try:
            shape = local_shape(ModelShape.of(hf_config), shard)
            attention_backend = get_attention_backend(
                model_config.attention_backend, device, shape.head_size, dtype,
                shape.num_heads // shape.num_kv_heads, block_size)
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(str(exc)) from None
        model, _ = load_model(model_config.model_dir, dtype, device, attention_backend, model_config.max_model_len,
                              shard=shard)
        kernels = getattr(attention_backend, "kernel", None)  # the CPU kernels, when attention uses them
        fused = kernels is not None and model_config.cpu_fused_ops
        if fused:
            model.use_cpu_kernels(kernels)
        runner = cls(model, num_blocks, block_size)
        runner.cpu_kernels = kernels
        runner.cupy_attention = attention_backend if getattr(attention_backend, "name", "") == "cupy" else None
        logger.info("model runner ready: device=%s dtype=%s attention=%s fused CPU ops=%s kv_blocks=%d x %d tokens%s",
                    device, dtype, getattr(attention_backend, "name", "?"), "on" if fused else "off", num_blocks,
                    block_size, f", tensor-parallel rank {shard.rank} of {shard.size}" if shard.sharded else "")
        return runner

    def copy_blocks(self, source_ids: Sequence[int], destination_ids: Sequence[int]) -> None:
        """Copy-on-write of whole blocks, on every rank's share of the cache."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.copy_blocks(source_ids, destination_ids)
        self.block_io.copy(source_ids, destination_ids)

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel group (nothing to do alone). Idempotent."""
        if self.tensor_parallel is not None:
            self._release(self.tensor_parallel, self._pinned)
            self.tensor_parallel = None

    @property
    def hf_config(self):
        return self.model.config

    @property
    def attention_backend(self):
        return self.model.attn_backend

    def prepare(self, scheduled: Sequence[ScheduledLike]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Builds (input_ids, positions, metadata, sample_rows, sample_indices) for one step.

        The batch lists the decodes (one new token) first, then the others, each group in
        scheduling order. sample_rows: the flattened row of each sampled request's last token;
        sample_indices: the position of that request in ``scheduled``.
        """
        bs = self.block_size
        num_seqs = len(scheduled)
        # Decodes (one new token) first: the attention backends take them as one block of rows; with
        # LoRA adapters, each group's rows by adapter (stable), so an adapter's rows are contiguous.
        order = [i for i, s in enumerate(scheduled) if s.num_new_tokens == 1]
        others = [i for i, s in enumerate(scheduled) if s.num_new_tokens != 1]
        if self.lora is not None:
            adapter = lambda i: scheduled[i].request.sampling_params.lora_name or ""  # noqa: E731
            order, others = sorted(order, key=adapter), sorted(others, key=adapter)
        order += others
        scheduled_in_order = [scheduled[i] for i in order]
        num_new = np.fromiter((s.num_new_tokens for s in scheduled_in_order), dtype=np.int64, count=num_seqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in scheduled_in_order), dtype=np.int64,
                                   count=num_seqs)
        seq_lens = num_computed + num_new
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        token_ids: list[int] = []
        blocks_needed = ceil_div(seq_lens, bs)
        block_tables = np.zeros((num_seqs, int(blocks_needed.max())), dtype=np.int32)  # padded with the null block
        sample_rows: list[int] = []
        sample_indices: list[int] = []
        for i, item in enumerate(scheduled_in_order):
            start, end = int(num_computed[i]), int(seq_lens[i])
            all_ids = item.request.all_token_ids
            spec = getattr(item, "spec_token_ids", None) or ()
            token_ids.extend(all_ids[start:end])
            if end > len(all_ids):  # proposed tokens after the known ones (speculative decoding)
                token_ids.extend(spec[max(0, start - len(all_ids)) : end - len(all_ids)])
            needed = int(blocks_needed[i])
            if len(item.block_ids) < needed:
                raise ValueError(
                    f"request {getattr(item.request, 'request_id', i)}: {len(item.block_ids)} blocks "
                    f"cannot hold {end} tokens (block_size {bs})"
                )
            block_tables[i, :needed] = item.block_ids[:needed]
            if end == len(all_ids) + len(spec):
                # From the last known token on, every position is scored: one row, or 1 + k when
                # k proposed tokens follow it (each row verifies the next proposal).
                num_rows = min(end - start, 1 + len(spec))
                last = int(query_start_loc[i + 1])
                sample_rows.extend(range(last - num_rows, last))
                sample_indices.extend([order[i]] * num_rows)

        self._row_starts = {order[i]: int(query_start_loc[i]) for i in range(num_seqs)}  # for prompt logprobs
        if self.lora is not None:
            self._row_adapters = [name for item, count in zip(scheduled_in_order, num_new.tolist(), strict=True)
                                  for name in [item.request.sampling_params.lora_name] * count]
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - num_computed, num_new)
        slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        device = self.device
        metadata = AttentionMetadata.build(
            torch.from_numpy(slot_mapping).to(device), torch.from_numpy(block_tables).to(device),
            seq_lens.tolist(), num_new.tolist(),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(device)
        return input_ids, torch.from_numpy(positions).to(device), metadata, sample_rows, sample_indices

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledLike],
                timings: dict[str, float] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Runs one step. Returns (logits [num_sampling_rows, vocab] float32, indices into ``scheduled``
        per row: a request verifying k proposed tokens has 1 + k consecutive rows).

        ``timings``, when given, gets the seconds of its phases: prepare, forward, logits.
        """
        if not scheduled:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device), []
        start = time.perf_counter()
        input_ids, positions, metadata, sample_rows, sample_indices = self.prepare(scheduled)
        prepared = time.perf_counter()
        if self.lora is not None:
            self.lora_hook.step = self.lora.step_for(self._row_adapters, metadata.num_decodes)
        try:
            if self.tensor_parallel is not None:
                self.tensor_parallel.forward(input_ids, positions, metadata,
                                             self._row_adapters if self.lora is not None else None)
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [num_tokens, hidden_size]
        except Exception:
            self._raise_if_rank_lost()
            raise
        finally:
            if self.lora is not None:
                self.lora_hook.step = None
        if self.device.type == "cuda" and timings is not None:
            torch.cuda.synchronize(self.device)
        forwarded = time.perf_counter()
        try:
            self.prompt_logprobs = self._prompt_logprobs(scheduled, hidden)  # before the rows are narrowed to sampling
            if not sample_rows:
                logits = torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
            else:
                rows = None
                if len(sample_rows) < hidden.shape[0]:
                    rows = torch.tensor(sample_rows, dtype=torch.int64, device=hidden.device)
                logits = self._logits(hidden, rows)
        except Exception:
            self._raise_if_rank_lost()
            raise
        if timings is not None:
            timings["prepare"] = timings.get("prepare", 0.0) + prepared - start
            timings["forward"] = timings.get("forward", 0.0) + forwarded - prepared
            timings["logits"] = timings.get("logits", 0.0) + time.perf_counter() - forwarded
        return logits, sample_indices

    def _logits(self, hidden: torch.Tensor, rows) -> torch.Tensor:  # hidden: [num_tokens, hidden_size]
        """compute_logits [len(rows), vocab] float32 of ``hidden``'s ``rows`` (see select_rows); the
        other ranks of a group compute their columns of the same rows."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.logits(rows)
        return self.model.compute_logits(select_rows(hidden, rows))

    def _raise_if_rank_lost(self) -> None:
        """A collective that failed because a worker died is that worker's death (WorkerLost)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.raise_if_lost(wait=2.0)

    def _prompt_logprobs(
        self,
        scheduled: Sequence[ScheduledLike],
        hidden: torch.Tensor,  # [num_tokens, hidden_size] the step's last hidden states, prepare()'s row order
    ) -> dict[int, tuple[int, list[float]]]:
        """{scheduled index: (first prompt position, logprobs)} for requests with prompt_logprobs.

        Row p of a chunk predicts token p + 1: its logprob is log_softmax(logits[p])[token p + 1],
        for every p of the chunk below the prompt's last token (which predicts the first output).
        Logits in slices of PROMPT_LOGPROBS_ROWS rows: a long prompt's [tokens, vocab] never exists at once.
        """
        found = {}
        for index, item in enumerate(scheduled):
            request = item.request
            if getattr(getattr(request, "sampling_params", None), "prompt_logprobs", None) is None:
                continue
            first = item.num_computed_tokens
            last = min(first + item.num_new_tokens, request.num_prompt_tokens - 1)  # positions first..last-1
            if last <= first:
                continue
            row = self._row_starts[index]
            targets = torch.tensor(request.all_token_ids[first + 1 : last + 1], dtype=torch.int64, device=hidden.device)
            values = []
            for offset in range(0, last - first, PROMPT_LOGPROBS_ROWS):
                count = min(PROMPT_LOGPROBS_ROWS, last - first - offset)
                logits = self._logits(hidden, (row + offset, row + offset + count))  # [count, vocab]
                values.extend(chosen_logprobs(logits, targets[offset : offset + count]).tolist())
            found[index] = (first, values)
        return found
