"""client.bench's multi-tenant workload (issue 32): growing sessions and the ideal prefix reuse."""

from __future__ import annotations

import pytest

from client.bench.lengths import parse_length
from client.bench.prompts import PromptBuilder, PromptError
from client.bench.tenants import Tenants, build_tenant_workload, prefix_reuse
from client.bench.workload import WorkItem


@pytest.fixture(scope="module")
def builder(demo_model_dir) -> PromptBuilder:
    return PromptBuilder(demo_model_dir)


def ids(builder: PromptBuilder, text: str) -> list[int]:
    return builder.tokenizer.encode(text, add_special_tokens=True).ids


def test_each_turn_extends_the_previous_turn_of_its_session_and_counts_are_exact(builder):
    tenants = Tenants(num_tenants=3, system_len=120, sessions_per_tenant=2, turns=3, user_len=20, answer_len=24)
    items = build_tenant_workload(builder, tenants, parse_length("8"), seed=5)
    assert len(items) == tenants.num_requests == 18
    for item in items:
        assert len(ids(builder, item.prompt)) == item.num_input_tokens and item.max_tokens == 8
    first_turns, middle_turns, last_turns = items[:6], items[6:12], items[12:]
    assert sorted(item.prefix_index for item in first_turns) == [0, 0, 1, 1, 2, 2]
    positions = []
    for first in first_turns:  # each session's later turns extend its earlier ones, one per round
        turns = [first]
        for later_round in (middle_turns, last_turns):
            [turn] = [item for item in later_round if item.prompt.startswith(turns[-1].prompt)]
            assert turn.prefix_index == first.prefix_index
            assert ids(builder, turn.prompt)[: turns[-1].num_input_tokens] == ids(builder, turns[-1].prompt)
            turns.append(turn)
        assert turns[-1].num_input_tokens == 120 + 3 * 20 + 2 * 24
        positions.append(tuple(items.index(turn) % 6 for turn in turns))
    assert any(len(set(p)) > 1 for p in positions)  # the rounds are not in one fixed session order
    systems = {item.prefix_index: ids(builder, item.prompt)[:120] for item in first_turns}
    assert len({tuple(system) for system in systems.values()}) == 3  # a system prompt per tenant
    assert build_tenant_workload(builder, tenants, parse_length("8"), seed=5) == items


def test_the_ideal_reuse_counts_full_blocks_seen_before():
    class Fake:
        class tokenizer:  # noqa: N801 (stands in for tokenizers.Tokenizer)
            @staticmethod
            def encode(text, add_special_tokens=True):
                return type("E", (), {"ids": [int(t) for t in text.split()]})

    first = WorkItem(" ".join(str(i) for i in range(40)), 40, 1)  # 2 full blocks of 16, then 8 tokens
    again = WorkItem(" ".join(str(i) for i in range(36)) + " 99 98 97 96", 40, 1)  # shares the 2 blocks
    other = WorkItem(" ".join(str(i + 500) for i in range(40)), 40, 1)
    reuse = prefix_reuse(Fake, [first, again, other])
    assert reuse == {"prompt_tokens": 120, "ideal_hit_tokens": 32, "ideal_hit_rate": 32 / 120}


def test_a_session_longer_than_the_model_allows_is_refused(builder):
    with pytest.raises(PromptError, match="max_model_len"):
        build_tenant_workload(builder, Tenants(1, 500, 1, 4, 100, 100), parse_length("8"), 0, max_model_len=800)
