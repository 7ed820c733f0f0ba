"""What one rank of a tensor-parallel group holds of the model, and the collectives its layers call.

The rule (Megatron's, as vLLM and TensorRT-LLM apply it):

- column-parallel, split by output rows: q/k/v (``qkv_proj``) by heads, gate/up (``gate_up_proj``
  and every expert's) by the intermediate dimension;
- row-parallel, split by input columns, then one all-reduce (sum): ``o_proj``, ``down_proj``, and a
  sparse MLP once for all its experts and its shared expert; a row-parallel bias is held by rank 0
  only, so the sum adds it once;
- KV heads divided across ranks, or, where there are fewer KV heads than ranks, each rank holds the
  one KV head its query heads read (replicated, as vLLM does);
- the vocabulary split for the embedding (each rank looks up its own rows, the rest are zeros, one
  all-reduce) and for lm_head (each rank's logits columns gathered on rank 0 for sampling);
  a vocabulary that does not divide is padded with zero rows, the padding's logits cut after the gather;
- everything else (norms, the MoE router, rotary tables) replicated.

Mixture-of-experts layers shard every expert by the same rule (tensor-parallel experts) rather than
placing whole experts on ranks (expert parallelism): each rank then does the same work whatever the
router picks, and the block needs the one all-reduce a dense MLP needs, where expert parallelism
needs an all-to-all of tokens each way and balances only when the routing does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from backend.models.family import ModelFamily, ModelLoadError
from backend.models.shape import ModelShape, ceil_div


class ShardingError(ModelLoadError):
    """The model cannot be split across this many ranks (a count that does not divide)."""


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of ``size``; ``group`` is the torch.distributed process group (None alone);
    ``collective_seconds`` adds up the time this rank spent in collectives (waiting for the other
    ranks included), which perf.tp_bench reads as the communication's share of a step."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    collective_seconds: list[float] = field(default_factory=lambda: [0.0], compare=False)
    shm: object | None = field(default=None, compare=False)  # backend/parallel/shm.py, ranks of one CPU host

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def even(self, total: int) -> tuple[int, int]:
        """(first index, count) of this rank's equal share of ``total`` (which must divide)."""
        count = total // self.size
        return self.rank * count, count

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, rows held, rows that are real) of this rank's vocabulary share (padded)."""
        per_rank = ceil_div(vocab_size, self.size)
        first = self.rank * per_rank
        return first, per_rank, max(0, min(per_rank, vocab_size - first))

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count): a share when they divide, else the one head this rank's query heads read."""
        if num_kv_heads >= self.size:
            return self.even(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    # ----------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks, in place (contiguous); returns it."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(tensor):
            self.shm.all_reduce(tensor)
        else:
            dist.all_reduce(tensor, group=self.group)
        self.collective_seconds[0] += time.perf_counter() - start
        return tensor

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor | None:  # local: [rows, columns_per_rank]
        """Rank 0: every rank's columns side by side [rows, size x columns_per_rank]; others: None."""
        local = local.contiguous()
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(local):
            gathered = self.shm.gather_columns(local)
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(local, parts, dst=0, group=self.group)
            gathered = torch.cat(parts, dim=1) if parts is not None else None
        self.collective_seconds[0] += time.perf_counter() - start
        return gathered


def check_shardable(hf_config, size: int) -> None:
    """Raises ShardingError naming both numbers when ``size`` ranks cannot split this model."""
    if size == 1:
        return
    shape = ModelShape.of(hf_config)
    family = ModelFamily.of(hf_config)
    counts = [("query heads (num_attention_heads)", shape.num_heads), ("intermediate_size", shape.intermediate_size)]
    for spec in {layer.moe for layer in family.layers if layer.moe is not None}:
        counts.append(("moe_intermediate_size", spec.intermediate_size))
        if spec.shared_intermediate_size:
            counts.append(("shared_expert_intermediate_size", spec.shared_intermediate_size))
    for what, count in counts:
        if count % size:
            raise ShardingError(f"tensor_parallel_size {size} does not divide the model's {count} {what}")
    if shape.num_kv_heads % size and size % shape.num_kv_heads:
        raise ShardingError(f"tensor_parallel_size {size} neither divides nor is a multiple of the model's "
                            f"{shape.num_kv_heads} KV heads (num_key_value_heads)")


def local_shape(shape: ModelShape, shard: TensorShard) -> ModelShape:
    """The shape one rank computes with: its heads and intermediate share; the vocabulary stays whole
    (the logits are gathered before anyone reads them)."""
    if not shard.sharded:
        return shape

    return replace(shape, num_heads=shape.num_heads // shard.size,
                   num_kv_heads=shard.kv_heads(shape.num_kv_heads)[1],
                   intermediate_size=shape.intermediate_size // shard.size)


# checkpoint projection -> how its tensor is split: "rows" (column-parallel), "columns" (row-parallel)
_ROWS = (".q_proj.", ".gate_proj.", ".up_proj.", ".w1.", ".w3.")
_KV = (".k_proj.", ".v_proj.")
_COLUMNS = (".o_proj.", ".down_proj.", ".w2.")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def shard_checkpoint_tensor(
    name: str,
    tensor: torch.Tensor,  # the checkpoint's whole tensor
    shard: TensorShard,
    shape: ModelShape,  # the whole model's shape
) -> torch.Tensor:  # this rank's part, in the checkpoint's layout
    """This rank's part of one checkpoint tensor, by the rule in the module docstring."""
    if not shard.sharded:
        return tensor
    is_bias = name.endswith(".bias")
    if name.endswith(_VOCAB):
        first, held, real = shard.vocab_rows(tensor.shape[0])
        part = tensor.new_zeros((held, *tensor.shape[1:]))
        part[:real] = tensor[first : first + real]
        return part
    if ".qkv_proj." in name:  # Phi's fused q/k/v: each part by its own rule
        q, k, v = tensor.split([shape.q_size, shape.kv_size, shape.kv_size], dim=0)
        return torch.cat([_split_rows(q, shard), _kv_part(k, shard, shape), _kv_part(v, shard, shape)], dim=0)
    if ".gate_up_proj." in name:  # Phi's fused gate/up
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([_split_rows(gate, shard), _split_rows(up, shard)], dim=0)
    if any(part in name for part in _KV):
        return _kv_part(tensor, shard, shape)
    if any(part in name for part in _ROWS):
        return _split_rows(tensor, shard)
    if any(part in name for part in _COLUMNS):
        if is_bias:  # added once, by rank 0, before the sum
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        first, count = shard.even(tensor.shape[1])
        return tensor[:, first : first + count]
    return tensor


def _split_rows(tensor: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    first, count = shard.even(tensor.shape[0])
    return tensor[first : first + count]


def _kv_part(tensor: torch.Tensor, shard: TensorShard, shape: ModelShape) -> torch.Tensor:
    first, count = shard.kv_heads(shape.num_kv_heads)
    return tensor[first * shape.head_size : (first + count) * shape.head_size]
