"""A multi-tenant workload: what a cache-aware router is for.

T tenants, each with its own long system prompt; each tenant runs S sessions of K turns. Turn k of
a session is the tenant's system prompt, then the session's earlier turns (each a user message and
an assistant answer of fixed token counts), then a new user message, so a session's history grows
turn by turn and every turn starts with the previous turn's whole prompt. (The assistant answers in
the history are corpus text, not what the server generated: what a later turn can reuse is the
earlier turns' prompts, as with any client that resends its history.) The list is K rounds, round
k holding every session's turn k in a fresh random order, so with Poisson arrivals (client.bench's
``--request-rate``) turn k is always sent after turn k-1, and a session's turns are never a fixed
number of requests apart (which would hand round-robin routing session affinity for free).

:func:`prefix_reuse` is the reference a router is measured against: the fraction of prompt tokens
in full KV blocks that one replica with an unbounded prefix cache would find cached, given the
requests in this order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from client.bench.lengths import LengthDistribution
from client.bench.prompts import PromptBuilder, PromptError
from client.bench.workload import WorkItem


@dataclass(frozen=True, slots=True)
class Tenants:
    num_tenants: int
    system_len: int  # tokens of each tenant's system prompt (special tokens included)
    sessions_per_tenant: int = 2
    turns: int = 3  # requests per session
    user_len: int = 48  # tokens of each user message
    answer_len: int = 48  # tokens of each earlier answer kept in the history

    @property
    def num_requests(self) -> int:
        return self.num_tenants * self.sessions_per_tenant * self.turns

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Tenants:
        """The tenants that ``add_tenant_arguments``'s options ask for."""
        return cls(args.tenants, args.system_len, args.sessions_per_tenant, args.turns, args.user_len,
                   args.answer_len)

    def to_dict(self) -> dict:
        return {"num_tenants": self.num_tenants, "system_len": self.system_len,
                "sessions_per_tenant": self.sessions_per_tenant, "turns": self.turns,
                "user_len": self.user_len, "answer_len": self.answer_len}


def add_tenant_arguments(parser: argparse.ArgumentParser, default_tenants: int = 0) -> None:
    """--tenants and the shape of their sessions (``Tenants.from_args`` reads them)."""
    parser.add_argument("--tenants", type=int, default=default_tenants,
                        help="multi-tenant sessions (client/bench/tenants.py): this many tenants, each with its own "
                             "--system-len system prompt and growing multi-turn sessions; sets the request count")
    parser.add_argument("--system-len", type=int, default=1024, help="--tenants: tokens of each system prompt")
    parser.add_argument("--sessions-per-tenant", type=int, default=2, help="--tenants: sessions of each tenant")
    parser.add_argument("--turns", type=int, default=3, help="--tenants: requests per session")
    parser.add_argument("--user-len", type=int, default=48, help="--tenants: tokens of each user message")
    parser.add_argument("--answer-len", type=int, default=48, help="--tenants: tokens of each answer kept in the history")


def build_tenant_workload(builder: PromptBuilder, tenants: Tenants, output_lengths: LengthDistribution, seed: int,
                          max_model_len: int | None = None) -> list[WorkItem]:
    """The requests in send order; ``prefix_index`` is the tenant, so a hash router can key on it."""
    if tenants.num_tenants < 1 or tenants.sessions_per_tenant < 1 or tenants.turns < 1:
        raise PromptError("tenants, sessions per tenant and turns must each be at least 1")
    longest = tenants.system_len + tenants.turns * tenants.user_len + (tenants.turns - 1) * tenants.answer_len
    if max_model_len is not None and longest >= max_model_len:
        raise PromptError(f"a session's last turn has {longest} prompt tokens, not below max_model_len {max_model_len}")
    rng = np.random.default_rng(seed)
    output_lens = iter(output_lengths.sample(rng, tenants.num_requests))
    systems = [builder.prompt(tenants.system_len, rng) for _ in range(tenants.num_tenants)]
    sessions = [(tenant, systems[tenant]) for tenant in range(tenants.num_tenants)
                for _ in range(tenants.sessions_per_tenant)]
    order = rng.permutation(len(sessions)).tolist()
    histories = {index: sessions[index][1] for index in order}
    lengths = {index: tenants.system_len for index in order}
    items = []
    for turn in range(tenants.turns):
        if turn:  # a new interleaving every round, so no session's turns fall at a fixed period
            order = rng.permutation(order).tolist()
        for index in order:
            prompt = builder.prompt_after_prefix(histories[index], tenants.user_len, rng)
            lengths[index] += tenants.user_len
            output_len = int(next(output_lens))
            if max_model_len is not None:
                output_len = max(1, min(output_len, max_model_len - lengths[index]))
            items.append(WorkItem(prompt, lengths[index], output_len, sessions[index][0]))
            if turn + 1 < tenants.turns:
                histories[index] = builder.prompt_after_prefix(prompt, tenants.answer_len, rng)
                lengths[index] += tenants.answer_len
    return items


def prefix_reuse(builder: PromptBuilder, items: list[WorkItem], block_size: int = 16) -> dict:
    """Prompt tokens in full blocks an unbounded prefix cache would hit, in request order."""
    seen: set[int] = set()  # chained block keys, as a prefix cache chains its block hashes
    total = hit = 0
    for item in items:
        ids = builder.tokenizer.encode(item.prompt, add_special_tokens=True).ids
        total += len(ids)
        key = None
        for end in range(block_size, len(ids) + 1, block_size):
            key = hash((key, tuple(ids[end - block_size:end])))
            if key in seen:
                hit += block_size
            else:
                seen.add(key)
    return {"prompt_tokens": total, "ideal_hit_tokens": hit, "ideal_hit_rate": hit / total if total else 0.0}
