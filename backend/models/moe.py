"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over a flattened batch.

Each token's router picks ``top_k`` experts (softmax in float32, then top-k, renormalised where the
config says). The step's (token, expert) pairs are sorted by expert once, so each expert with work
runs one gated-MLP GEMM pair on its tokens, contiguous, and the weighted results are added back
to their tokens with one ``index_add_``: no per-token Python, and an expert nobody chose costs
nothing. Experts are stacked in two parameters ([num_experts, 2 * intermediate, hidden] and
[num_experts, hidden, intermediate]) the loader fills from the per-expert checkpoint tensors;
nothing here assumes the experts share a device with each other beyond those two tensors (expert
parallelism would shard their first dimension). Tensor-parallel, each rank holds every expert's
share of the intermediate dimension and the block's output is summed over the ranks once. On the
CPU kernels (``use_kernels``) the experts run in one kernel call instead (moe_cpu.py); the routing
stays here, so both paths choose the same experts with the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.activation import activation_fn
from backend.models.cpu_linear import Linear, packed_linear, prepack_weight
from backend.models.family import MoeSpec
from backend.models.moe_cpu import CpuExperts


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec, activation: str, shared_expert: nn.Module | None = None):
        super().__init__()
        self.spec = spec
        self.hidden_size = hidden_size
        self.gate = Linear(hidden_size, spec.num_experts, bias=False)
        inter = spec.intermediate_size
        self.experts_gate_up = nn.Parameter(torch.empty(spec.num_experts, 2 * inter, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(spec.num_experts, hidden_size, inter))
        self.act = activation_fn(activation)
        self.activation = activation
        self.shared_expert = shared_expert  # Qwen2-MoE: a dense MLP every token also runs, gated
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert, oneDNN-packed (CPU)
        self.reduce = None  # tensor-parallel: the group's all-reduce, once for every expert (backend/parallel)
        self.cpu_experts: CpuExperts | None = None  # the experts as one CPU kernel call, see use_kernels

    def use_kernels(self, kernels) -> bool:
        """Runs the experts through the CPU kernel (moe_cpu.py) where it serves them."""
        if not CpuExperts.serves(self.experts_gate_up, self.activation):
            return False
        self.cpu_experts = CpuExperts(kernels, self.experts_gate_up, self.experts_down)
        if self.cpu_experts.max_tokens is None:  # the kernel serves every step: oneDNN's copies are not needed
            self.packed = None
        return True

    def prepack(self) -> bool:
        """Each expert's two GEMMs on oneDNN-prepacked weights, as every Linear (cpu_linear.py)."""
        packed = [(prepack_weight(self.experts_gate_up[e]), prepack_weight(self.experts_down[e]))
                  for e in range(self.spec.num_experts)]
        self.packed = None if any(w is None for pair in packed for w in pair) else packed
        return self.packed is not None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k] int64)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden_size] -> same
        weights, experts = self.route(x)
        if self.spec.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        if self.cpu_experts is not None and self.cpu_experts.takes(x):
            return self.finish(x, self.cpu_experts(x, weights, experts))
        top_k = self.spec.top_k
        flat = experts.reshape(-1)  # [num_tokens * top_k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        token_of = order // top_k  # [num_tokens * top_k]: the token of each sorted pair
        pair_weight = weights.reshape(-1)[order].unsqueeze(1)  # [num_tokens * top_k, 1]
        routed = x.index_select(0, token_of)  # [num_tokens * top_k, hidden_size], grouped by expert
        inter = self.spec.intermediate_size
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            if self.packed is not None:
                gate_up = packed_linear(routed[start:end], self.packed[expert][0], None)  # [count, 2 * inter]
            else:
                gate_up = F.linear(routed[start:end], self.experts_gate_up[expert])
            hidden = self.act(gate_up[:, :inter]) * gate_up[:, inter:]
            down = (packed_linear(hidden, self.packed[expert][1], None) if self.packed is not None
                    else F.linear(hidden, self.experts_down[expert]))
            down = down * pair_weight[start:end]  # [count, hidden_size]
            out.index_add_(0, token_of[start:end], down.to(x.dtype))
            start = end
        return self.finish(x, out)

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # both [num_tokens, hidden_size]
        """The routed experts' sum plus the shared expert, summed over tensor-parallel ranks."""
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.reduce is not None:
            self.reduce(out)
        return out
