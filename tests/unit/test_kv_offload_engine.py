"""The engine with a KV offload tier (issue 19): evicted prefixes come back with the same tokens.

A tiny pool forces the shared prefix out between its requests; with the tier its blocks return
from host memory or disk instead of being recomputed, and greedy output equals the engine's
without the tier token for token (also with small prefill chunks and under preemption). Tampering
with the tier's KV changes the output, so the restored KV is what the model attends to. The disk
tier serves a restarted engine; a corrupted block file there is recomputed, never loaded.
"""

from __future__ import annotations

import random

import pytest

from backend.config import ConfigError, engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.kv_cache.block_pool import hash_block_tokens
from backend.kv_cache.offload.disk_tier import file_name
from backend.models.demo_model import DEMO_REPOSITORY
from backend.protocol.sampling import SamplingParams

rng = random.Random(19)
PREFIX = [rng.randrange(10, 8000) for _ in range(200)]  # 12 full blocks of 16
FILLERS = [[rng.randrange(10, 8000) for _ in range(150)] for _ in range(4)]
PROMPTS = [PREFIX + [5, 6, 7], *FILLERS, PREFIX + [8, 9], PREFIX + [11]]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
SMALL_POOL = {"num_kv_blocks": "30", "block_size": "16"}  # one prompt at a time fits, two do not


def engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **{**SMALL_POOL, **overrides}))


def offloading(tier: str, tmp_path, **overrides: str) -> LLMEngine:
    return engine(kv_offload_tier=tier, kv_offload_dir=str(tmp_path), kv_offload_load_policy="always", **overrides)


def one_by_one(llm: LLMEngine, prompts=PROMPTS) -> list[list[int]]:
    return [llm.generate([prompt], [PARAMS])[0].output_token_ids for prompt in prompts]


@pytest.fixture(scope="module")
def expected(demo_model_dir) -> list[list[int]]:
    return one_by_one(engine())


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_prefixes_come_back_from_the_tier_with_the_same_tokens(tmp_path, expected, tier):
    llm = offloading(tier, tmp_path)
    assert one_by_one(llm) == expected
    stats = llm.offloader.stats
    assert stats.stored_blocks > 0 and stats.dropped_blocks == 0
    assert stats.restored_blocks == 12  # the prefix after the fillers; its third use hits the pool
    assert llm.kv_cache_manager.usage == 0.0 and llm.stats().kv_offload_restored_blocks == 12
    llm.close()


def test_small_prefill_chunks_and_several_requests_at_once_give_the_same_tokens(tmp_path, expected):
    llm = offloading("host", tmp_path, max_num_batched_tokens="40")
    assert one_by_one(llm) == expected
    assert llm.offloader.stats.restored_blocks > 0
    longer = SamplingParams(max_tokens=48, ignore_eos=True)  # two requests outgrow the pool: preemption
    together = engine(max_num_batched_tokens="40")  # the same pool, no tier
    reference = together.generate(PROMPTS, [longer] * len(PROMPTS))
    llm.offloader.flush()
    results = llm.generate(PROMPTS, [longer] * len(PROMPTS))
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in reference]
    assert llm.scheduler.num_preemptions > 0 and llm.kv_cache_manager.usage == 0.0
    llm.close()


def test_tampered_tier_kv_changes_the_output(tmp_path, expected):
    """The negative control: the tokens above match because the restored KV is the right KV."""
    llm = offloading("host", tmp_path)
    one_by_one(llm, PROMPTS[:5])  # the prefix is in the tier now
    llm.offloader.flush()
    for stored in llm.offloader.tier._entries.values():
        stored.kv = -stored.kv
    assert one_by_one(llm, PROMPTS[5:6]) != expected[5:6]
    assert llm.offloader.stats.restored_blocks == 12
    llm.close()


def test_the_disk_tier_serves_a_restarted_engine(tmp_path, expected):
    first = offloading("disk", tmp_path)
    one_by_one(first, PROMPTS[:1])
    first.close()  # at shutdown the prefixes still in the pool are written too
    restarted = offloading("disk", tmp_path)
    result = restarted.generate([PROMPTS[5]], [PARAMS])[0]
    assert result.output_token_ids == expected[5]
    assert restarted.offloader.stats.restored_blocks == 12
    assert restarted.requests == {} and restarted.kv_cache_manager.prefix_queries == len(PROMPTS[5])
    restarted.close()


def test_a_corrupted_block_file_is_recomputed_not_loaded(tmp_path, expected):
    first = offloading("disk", tmp_path)
    one_by_one(first, PROMPTS[:1])
    first.close()
    restarted = offloading("disk", tmp_path)
    tier = restarted.offloader.tier
    path = tier.folder / file_name(prefix_hashes()[4])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert restarted.generate([PROMPTS[5]], [PARAMS])[0].output_token_ids == expected[5]
    assert tier.num_rejected == 1 and not path.exists()
    assert restarted.offloader.stats.restored_blocks == 4  # the blocks before the bad one
    restarted.close()


def prefix_hashes() -> list[int]:
    hashes: list[int] = []
    for i in range(len(PREFIX) // 16):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, PREFIX[i * 16:(i + 1) * 16]))
    return hashes


def test_the_cost_rule_recomputes_when_prefill_is_cheaper(tmp_path, expected):
    llm = engine(kv_offload_tier="host")  # policy auto
    llm.offloader.prefill_tokens_per_second = 1e9  # recomputing looks free
    for _ in range(3):
        assert one_by_one(llm) == expected
        llm.offloader.prefill_tokens_per_second = 1e9  # the measured steps must not win it back
    stats = llm.offloader.stats
    assert stats.restored_blocks == 0 and stats.recomputed_blocks > 0 and stats.hit_blocks == stats.recomputed_blocks
    llm.close()


def test_configuration_errors_name_the_parameter(demo_model_dir):
    with pytest.raises(ConfigError, match="kv_offload_tier"):
        engine(kv_offload_tier="disk", enable_prefix_caching="false")
    with pytest.raises(ConfigError, match="kv_offload_tier"):
        engine(kv_offload_tier="nvme")
    with pytest.raises(ConfigError, match="kv_offload_load_policy"):
        engine(kv_offload_tier="host", kv_offload_load_policy="sometimes")
