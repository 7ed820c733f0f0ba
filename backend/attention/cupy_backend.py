"""Attention on NVIDIA GPUs with our CUDA kernels (kernels/*.cu) launched through CuPy.

What runs where (the order, the decodes-first batch and the prefill path are shared with the
torch backend: backend/attention/paged.py):
  * every step: ``reshape_and_cache`` writes the new K/V into their slots (slot -1 is skipped);
  * sequences with one new token (decode): ``paged_attention_decode`` reads the paged cache
    directly, split into partitions of PARTITION_SIZE tokens and combined by
    ``paged_attention_reduce`` when the context is longer than one partition; with a sliding
    window W, from position seq_len - W on (the kernel reads nothing before it);
  * sequences with several new tokens (prefill, chunked prefill): the shared torch SDPA path.
The kernels' argument tuples are packed in one place, kernels/launch_args.py.

The modules are compiled with cupy.RawModule and the options in kernels/build_options.py, one
module per cache dtype and head size, once: when the backend is built with head_size and dtype
(at model load), else at the first forward of each. Kernels run on
torch's current stream (cupy.cuda.ExternalStream) and take torch tensors zero-copy through DLPack.
CuPy is imported only here and only when a backend is built for a GPU: the engine imports without
it. ``cupy_available()`` says whether this machine can run the backend, and why not.

For tests without a GPU, ``module_factory`` and ``launch`` can be replaced by the CPU emulation
(kernels/emulation): the same launch code, argument packing and prefill path then run on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from backend.attention.base import AttentionMetadata
from backend.attention.paged import PagedAttentionBackend
from backend.models.shape import ceil_div
from kernels.build_options import (
    NUM_THREADS,
    PARTITION_SIZE,
    RESHAPE_MAX_THREADS,
    ModuleSpec,
    paged_attention_spec,
    reshape_and_cache_spec,
)
from kernels.launch_args import cache_write_args, decode_args, reduce_args

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

ModuleFactory = Callable[[ModuleSpec], Any]  # spec -> object with get_function(name), like cupy.RawModule
Launch = Callable[[Any, tuple[int, ...], tuple[int, ...], tuple[Any, ...]], None]  # kernel, grid, block, args


def cupy_available() -> tuple[bool, str]:
    """(True, description) when CuPy, a CUDA device and NVRTC are usable here, else (False, reason)."""
    try:
        import cupy  # noqa: PLC0415 (optional: cupy, on NVIDIA GPUs only)
    except Exception as exc:  # ImportError, or a CUDA library error raised while importing
        return (
            False,
            f"CuPy is not importable ({type(exc).__name__}: {exc}); install the gpu extra (cupy-cuda12x)",
        )
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "CuPy sees no CUDA device"
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        return False, f"CuPy cannot load NVRTC ({type(exc).__name__}: {exc}); install nvidia-cuda-nvrtc-cu12"
    return True, f"CuPy {cupy.__version__}, NVRTC {major}.{minor}, {count} CUDA device(s)"


@cache
def cupy_module(spec: ModuleSpec) -> Any:
    """Compiles one module with NVRTC and loads its kernels (cached per process; CuPy also
    caches binaries on disk, keyed by the self-contained source and options).

    CuPy usually finds cuda_fp16.h / cuda_bf16.h itself; where it does not, the compile is
    retried with the folder kernels.nvrtc.cuda_include_dir() finds (a CUDA toolkit's, or the
    nvidia-cuda-runtime-cu12 wheel's).
    """
    import cupy  # noqa: PLC0415 (optional: cupy, on NVIDIA GPUs only)

    from kernels.nvrtc import cuda_include_dir  # noqa: PLC0415 (optional: only where CuPy compiles a kernel)

    def build(options: tuple[str, ...]) -> Any:
        module = cupy.RawModule(code=spec.code(), options=options)
        for name in spec.kernel_names:  # compiles and loads now, at model load, not mid-request
            module.get_function(name)
        return module

    try:
        return build(spec.options)
    except Exception as first:
        include = cuda_include_dir()
        if include is None or not any(h in str(first) for h in ("cuda_fp16.h", "cuda_bf16.h")):
            hint = " (install nvidia-cuda-runtime-cu12 for cuda_fp16.h)" if include is None else ""
            raise RuntimeError(
                f"compiling kernels/{spec.source} {' '.join(spec.options)} failed{hint}: {first}"
            ) from first
        try:
            return build((*spec.options, f"-I{include}"))
        except Exception as exc:
            raise RuntimeError(
                f"compiling kernels/{spec.source} {' '.join(spec.options)} -I{include} failed: {exc}"
            ) from exc


def cupy_launch(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
    """Launches on torch's current stream of the tensors' device; tensors go over DLPack (bf16 as
    its int16 bits: CuPy has no bfloat16, the kernel only needs the pointer)."""
    import cupy  # noqa: PLC0415 (optional: cupy, on NVIDIA GPUs only)

    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with (
        cupy.cuda.Device(device.index),
        cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream),
    ):
        converted = tuple(
            cupy.from_dlpack(a.view(torch.int16) if a.dtype == torch.bfloat16 else a)
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        )
        kernel(grid, block, converted)


@dataclass(frozen=True, slots=True)
class _Kernels:
    """The compiled kernels for one cache dtype and head size."""

    decode: Any
    reduce: Any
    cache_write: Any


class CupyAttentionBackend(PagedAttentionBackend):
    """The paged-attention backend for NVIDIA GPUs (see the module docstring).

    ``CupyAttentionBackend(device, head_size=..., dtype=...)`` compiles the modules right away (at
    model load); without them it compiles on the first forward of each dtype and head size. On a
    machine where ``cupy_available()`` is false, building it raises RuntimeError saying why.
    """

    name = "cupy"

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        head_size: int | None = None,
        dtype: torch.dtype | None = None,
        partition_size: int = PARTITION_SIZE,
        module_factory: ModuleFactory | None = None,
        launch: Launch | None = None,
    ) -> None:
        super().__init__()
        self.device = torch.device(device) if device is not None else None
        if module_factory is None:
            if self.device is not None and self.device.type != "cuda":
                raise ValueError(f"attention_backend=cupy needs a CUDA device, got device '{self.device}'")
            ok, reason = cupy_available()
            if not ok:
                raise RuntimeError(
                    f"attention_backend=cupy cannot run here: {reason}. "
                    "Use attention_backend=torch, or auto to pick cupy only where it can run."
                )
            module_factory, launch = cupy_module, cupy_launch
        if launch is None:
            raise ValueError("a custom module_factory needs its launch function")
        self.partition_size = partition_size
        self.module_factory = module_factory  # also what other CUDA kernels of the model use (LoRA)
        self.launch = launch
        self._kernels: dict[tuple[torch.dtype, int], _Kernels] = {}
        self._placeholders: dict[torch.device, torch.Tensor] = {}
        if (head_size is None) != (dtype is None):
            raise ValueError("pass head_size and dtype together (or neither)")
        if head_size is not None and dtype is not None:
            self.load(head_size, dtype)

    def load(self, head_size: int, dtype: torch.dtype) -> None:
        """Compiles the modules for one cache dtype and head size (once; call at model load)."""
        self._get_kernels(dtype, head_size)

    def _get_kernels(self, dtype: torch.dtype, head_size: int) -> _Kernels:
        key = (dtype, head_size)
        if key not in self._kernels:
            if dtype not in DTYPE_NAMES:
                raise ValueError(
                    f"attention_backend=cupy: unsupported dtype {dtype} (float32, float16 or bfloat16)"
                )
            name = DTYPE_NAMES[dtype]
            attention = self.module_factory(
                paged_attention_spec(name, head_size, partition_size=self.partition_size)
            )
            cache_write = self.module_factory(reshape_and_cache_spec(name))
            self._kernels[key] = _Kernels(
                attention.get_function("paged_attention_decode"),
                attention.get_function("paged_attention_reduce"),
                cache_write.get_function("reshape_and_cache"),
            )
        return self._kernels[key]

    # ---- what the shared forward calls ------------------------------------------------------------

    def plan_step(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int = 0) -> int:
        return window  # the kernels take the metadata's tensors as they are; the plan is the window

    def write_cache(self, key, value, key_cache, value_cache, metadata: AttentionMetadata, plan) -> None:
        self.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)

    def decode(self, query, key_cache, value_cache, metadata: AttentionMetadata, plan: int, scale: float) -> torch.Tensor:
        num_decodes = metadata.num_decodes
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self.decode_into(
            out, query, key_cache, value_cache, metadata.block_tables[:num_decodes], metadata.seq_lens[:num_decodes],
            scale, max(metadata.seq_lens_list[:num_decodes]), sliding_window=plan,
        )
        return out

    # ---- the kernels ----------------------------------------------------------------------------

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    ) -> None:
        """reshape_and_cache: K/V of token t go to slot slot_mapping[t]."""
        num_tokens, num_kv_heads, head_size = key.shape
        if num_tokens == 0:
            return
        for name, t in (("key", key), ("value", value)):
            if t.dtype != key_cache.dtype or t.stride(2) != 1 or t.stride(1) != head_size:
                raise ValueError(
                    f"{name} must be {key_cache.dtype} with contiguous heads, got {t.dtype} strides {t.stride()}"
                )
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"slot_mapping must be int64 [num_tokens], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            )
        threads = min(RESHAPE_MAX_THREADS, 32 * ceil_div(num_kv_heads * head_size, 32))
        self.launch(
            self._get_kernels(key_cache.dtype, head_size).cache_write, (num_tokens,), (threads,),
            cache_write_args(key, value, key_cache, value_cache, slot_mapping.contiguous()),
        )

    def decode_into(
        self,
        out: torch.Tensor,  # [num_seqs, num_heads, head_size], written
        query: torch.Tensor,  # [num_seqs, num_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        scale: float,
        max_seq_len: int,
        sliding_window: int = 0,  # each sequence attends its last sliding_window positions; 0: all
    ) -> None:
        """paged_attention_decode (+ reduce over partitions): one query token per sequence."""
        num_seqs, num_heads, head_size = query.shape
        num_kv_heads = key_cache.shape[2]
        if num_seqs == 0:
            return
        kernels = self._get_kernels(query.dtype, head_size)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if query.stride(2) != 1 or not out.is_contiguous():
            raise ValueError("query rows must have a contiguous head dimension and out must be contiguous")
        if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables must be int32 with contiguous rows, got {block_tables.dtype}")
        seq_lens = seq_lens.to(torch.int32).contiguous()
        sliding_window = sliding_window or 0
        attended = min(max_seq_len, sliding_window) if sliding_window > 0 else max_seq_len
        num_partitions = max(1, ceil_div(attended, self.partition_size))
        if num_partitions == 1:
            tmp_out = max_logits = exp_sums = self._placeholder(query.device)
        else:
            tmp_out = torch.empty(
                (num_seqs, num_heads, num_partitions, head_size),
                dtype=torch.float32,
                device=query.device,
            )
            max_logits = torch.empty(
                (num_seqs, num_heads, num_partitions), dtype=torch.float32, device=query.device
            )
            exp_sums = torch.empty_like(max_logits)
        self.launch(
            kernels.decode, (num_heads, num_seqs, num_partitions), (NUM_THREADS,),
            decode_args(out, tmp_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables, seq_lens,
                        scale, sliding_window),
        )
        if num_partitions > 1:
            self.launch(kernels.reduce, (num_heads, num_seqs), (NUM_THREADS,),
                         reduce_args(out, tmp_out, max_logits, exp_sums, seq_lens, num_partitions, sliding_window))

    # ---- checks ---------------------------------------------------------------------------------

    def check_cache(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
            raise ValueError(
                f"query and caches must share a dtype, got query {query.dtype}, cache {key_cache.dtype}"
            )
        if key_cache.shape[-1] != query.shape[-1]:
            raise ValueError(f"query head size {query.shape[-1]} != cache head size {key_cache.shape[-1]}")
        if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
            raise ValueError("key_cache and value_cache must have the same shape and strides")
        vec = 16 // key_cache.element_size()  # the decode kernel reads 16-byte vectors
        if key_cache.stride(3) != 1 or any(s % vec for s in key_cache.stride()[:3]):
            raise ValueError(
                f"cache rows must be contiguous and 16-byte aligned, got strides {key_cache.stride()}"
            )
        if key_cache.data_ptr() % 16 or value_cache.data_ptr() % 16:
            raise ValueError("key_cache and value_cache must start on a 16-byte boundary")

    def _placeholder(self, device: torch.device) -> torch.Tensor:
        """A one-element float32 buffer for the partition arguments a one-partition launch ignores."""
        if device not in self._placeholders:
            self._placeholders[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return self._placeholders[device]

