"""Tensor parallelism on the CPU with gloo (backend/parallel): a group of ranks gives the tokens one
rank gives, for every family, and a dead rank costs errors and a restart, never a hang.

Parity runs in float32 with the near-tie rule of the family and real-model parity tests (a mismatch
is excused only where transformers' own top-2 logit gap is below 1e-4: the ranks' partial sums add
in another order). The demo model runs at size 2 (8 query and 2 KV heads) against size 1, batched
with prefix hits, chunked prefill, preemption, ``n`` (copy-on-write on every rank), prompt-lookup
speculation and logprobs; SmolLM2 at size 3 (9 and 3 heads) against transformers; each random
family checkpoint at size 2 against transformers (Mistral's single KV head replicated, a vocabulary
that does not divide padded). A worker killed with SIGKILL mid-stream ends each request in flight
once with an error naming the rank, the core and every rank restart, the next request is served
and no old rank is left.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from backend.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    engine_config_from_model_folder,
    validate_engine_config,
)
from backend.engine.llm_engine import LLMEngine
from backend.engine_core.process_client import ProcessClient
from backend.kv_cache.manager import KVCacheManager
from backend.models.family import ModelFamily
from backend.models.shape import ModelShape
from backend.parallel.shard import TensorShard, local_shape
from backend.protocol.messages import AddRequest
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY
from tests.unit import test_model_families as families
from tests.unit import test_real_model_parity as real
from tests.unit.random_models import build_random_model, get_random_model, make_config

WORKER_MODULE = b"backend.runner.tp_worker"


def with_size(config: EngineConfig, size: int, **cache) -> EngineConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, tensor_parallel_size=size),
                               cache=dataclasses.replace(config.cache, **cache) if cache else config.cache)


def worker_pids() -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if WORKER_MODULE in handle.read():
                        found.add(int(entry))
            except OSError:
                continue
    return found


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while pids & worker_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids & worker_pids()


# --------------------------------------------------------------------------------- the demo model
DEMO_PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time " * 12, "1, 2, 3,",
                "Once upon a time " * 12 + "the end", "A B C D E F G " * 6]


def demo_run(engine: LLMEngine) -> list:
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.0),
              SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, stop=["zzz"]),
              SamplingParams(max_tokens=30, ignore_eos=True)]
    first = engine.generate(DEMO_PROMPTS, params)
    second = engine.generate(DEMO_PROMPTS, params)  # prefix hits
    return first + second


def test_demo_model_at_size_2_equals_size_1_with_prefix_hits_chunks_preemption_n_and_speculation(demo_model_dir):
    base = engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"))
    base = dataclasses.replace(
        base, scheduler=dataclasses.replace(base.scheduler, max_num_batched_tokens=32, enable_chunked_prefill=True),
        speculative=SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3))
    results, stats = {}, {}
    for size in (1, 2):
        engine = LLMEngine(with_size(base, size, num_kv_blocks=14, block_size=16))  # too few: preemption
        try:
            results[size] = demo_run(engine)
            stats[size] = engine.stats()
        finally:
            engine.close()
    assert stats[2].num_preemptions > 0 and stats[2].prefix_cache_hits > 0
    for one, two in zip(results[1], results[2], strict=True):
        assert two.error is None
        assert two.output_token_ids == one.output_token_ids
        assert [s.output_token_ids for s in two.samples] == [s.output_token_ids for s in one.samples]
        assert torch.allclose(torch.tensor(two.logprobs), torch.tensor(one.logprobs), atol=1e-4)
        if one.prompt_logprobs is not None:
            assert torch.allclose(torch.tensor(two.prompt_logprobs), torch.tensor(one.prompt_logprobs), atol=1e-4)


def test_sizes_that_do_not_divide_are_refused_naming_both_numbers(demo_model_dir):
    base = engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*3 does not divide the model's 8 query heads"):
        LLMEngine(with_size(base, 3))
    with pytest.raises(ConfigError, match=r"'kv_role': not with tensor_parallel_size 2"):
        validate_engine_config(dataclasses.replace(with_size(base, 2), kv_transfer=KVTransferConfig(kv_role="prefill")))


def test_each_rank_holds_its_share_and_kv_heads_replicate_below_the_rank_count():
    shape = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_size=64, hidden_size=576,
                       intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    assert local_shape(shape, TensorShard(1, 3)) == dataclasses.replace(shape, num_heads=3, num_kv_heads=1,
                                                                         intermediate_size=512)
    one_kv = dataclasses.replace(shape, num_heads=4, num_kv_heads=1)
    assert [TensorShard(r, 2).kv_heads(1) for r in range(2)] == [(0, 1), (0, 1)]
    assert [TensorShard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert local_shape(one_kv, TensorShard(0, 2)).num_kv_heads == 1
    assert [TensorShard(r, 2).vocab_rows(1021) for r in range(2)] == [(0, 511, 511), (511, 511, 510)]


# --------------------------------------------------------------------------------- SmolLM2 at size 3
@pytest.fixture(scope="module")
def smollm2_dir():
    from backend.models.smollm2_model import build

    return build()  # made by make setup; a no-op then


def test_smollm2_at_size_3_equals_transformers(smollm2_dir):
    folder = str(smollm2_dir)
    expected, gaps = real.hf_reference(folder)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=folder, tokenizer_dir=folder, dtype="float32", device="cpu",
                          max_model_len=2048, tensor_parallel_size=3),
        cache=CacheConfig(block_size=16, num_kv_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, default_max_tokens=16),
    ))
    try:
        assert engine.model_runner.model.shape.num_heads == 3
        prompts = real.prompts_for(folder)
        got = real.generate(engine, prompts)  # stops at <|im_end|> as transformers does
    finally:
        engine.close()
    near_ties = real.compare(got, expected, gaps)
    print(f"\nSmolLM2 at tensor_parallel_size 3: {len(prompts)} prompts, {near_ties} near-ties")


# --------------------------------------------------------------------------------- each family at size 2
TP_FAMILIES = [*families.FAMILIES, "mistral_1kv", "qwen2_tied"]


def family_engine(model_key: str, size: int, num_kv_blocks: int, tokenizer_dir: str) -> LLMEngine:
    """families.engine_for's engine (CPU kernels, chunks of 24 tokens) at ``size`` ranks."""
    return LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=get_random_model(model_key)[0], tokenizer_dir=tokenizer_dir, dtype="float32",
                          device="cpu", attention_backend="cpu", max_model_len=1024, tensor_parallel_size=size),
        cache=CacheConfig(block_size=16, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=24, enable_chunked_prefill=True,
                                  default_max_tokens=16),
    ))


@pytest.mark.parametrize("model_key", TP_FAMILIES)
def test_each_family_at_size_2_equals_transformers_with_chunks_prefix_hits_and_preemption(model_key, demo_model_dir):
    expected, gaps = families.hf_reference(model_key, shared_prefix=37)
    prompts = families.prompts_for(model_key, shared_prefix=37)
    longest = max(len(p) for p in prompts) + families.MAX_TOKENS
    window = ModelFamily.of(make_config(model_key)).shared_window  # every layer slides: a request holds its window
    per_request = KVCacheManager(2, 16, enable_caching=False, sliding_window=window).max_blocks_held(longest, 24)
    engine = family_engine(model_key, 2, 2 * per_request + 2, str(demo_model_dir))  # too few: preemption
    try:
        first = families.generate(engine, prompts)
        second = families.generate(engine, prompts)
        stats = engine.stats()
    finally:
        engine.close()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    near_ties = families.compare(first, expected, gaps) + families.compare(second, expected, gaps)
    print(f"\n{model_key} at tensor_parallel_size 2: {near_ties} near-ties")


def test_a_vocabulary_that_does_not_divide_is_padded(tmp_path, demo_model_dir):
    hf_model = build_random_model("llama_gqa4", tmp_path / "odd", vocab_size=1021)
    prompts = [[5, 17, 300, 1020, 9], [44] * 30]
    with torch.inference_mode():
        expected = [hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=str(tmp_path / "odd"), tokenizer_dir=str(demo_model_dir), dtype="float32",
                          device="cpu", max_model_len=512, tensor_parallel_size=2),
        cache=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, default_max_tokens=16)))
    try:
        assert engine.model_runner.model.model.embed_tokens.weight.shape[0] == 511
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        got = [r.output_token_ids for r in engine.generate(prompts, [params] * 2)]
    finally:
        engine.close()
    assert got == expected


# --------------------------------------------------------------------------------- a dead rank
def test_a_worker_killed_mid_stream_ends_each_request_once_and_every_rank_restarts(demo_model_dir):
    from transformers import AutoTokenizer

    from tests.unit.test_engine_core_process import run_after_restart

    config = with_size(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")), 2)
    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_dir)

    def add(request_id: str, prompt: str, **params) -> AddRequest:
        return AddRequest(request_id, tokenizer(prompt)["input_ids"], SamplingParams(**params), time.monotonic())

    client = ProcessClient(config, max_queue_len=64, heartbeat_timeout=10.0)
    before = worker_pids()
    client.start()
    restarts = []
    client.on_restart = restarts.append
    try:
        (old_worker,) = worker_pids() - before
        if len(os.sched_getaffinity(0)) >= 2:  # each rank on its own core
            assert os.sched_getaffinity(old_worker) != os.sched_getaffinity(client.core_pid)
            assert len(os.sched_getaffinity(old_worker)) == len(os.sched_getaffinity(client.core_pid)) == 1
        for i in range(3):
            client.submit(add(f"long{i}", DEMO_PROMPTS[i], max_tokens=1500, ignore_eos=True))
        client.flush()
        streamed = set()
        while len(streamed) < 3:  # every request is mid-stream
            item = client.outbox.get(timeout=60)
            streamed.update(o.request_id for o in item[0] if o.new_token_ids)
        killed_at = time.monotonic()
        os.kill(old_worker, signal.SIGKILL)
        finals = {}
        while len(finals) < 3:
            item = client.outbox.get(timeout=15)
            for output in item[0]:
                if output.finished:
                    assert output.request_id not in finals, f"a second final for {output.request_id}"
                    finals[output.request_id] = output
        ended = time.monotonic() - killed_at
        assert all("tensor-parallel rank 1" in f.error and "SIGKILL" in f.error for f in finals.values()), finals
        # refused as busy while the new core and its worker load, then served
        results = run_after_restart(client, lambda: add("after", "Hello", max_tokens=8, ignore_eos=True),
                                    timeout=90)
        served = time.monotonic() - killed_at
        assert results["after"][1].error is None and results["after"][1].num_output_tokens == 8
        assert len(restarts) == 1 and client.restarts == 1
        assert not wait_gone({old_worker}, 5)
        new_workers = worker_pids() - before
        assert len(new_workers) == 1 and old_worker not in new_workers
        print(f"\nworker SIGKILL: requests ended {ended:.2f} s after the kill, the next one served after {served:.2f} s")
    finally:
        client.stop(timeout=10)
    assert not wait_gone(worker_pids() - before, 10), "stop() left a tensor-parallel rank running"


def test_a_killed_rank_0_takes_its_workers_with_it(demo_model_dir):
    config = with_size(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")), 2)
    client = ProcessClient(config, max_queue_len=8, heartbeat_timeout=10.0)
    before = worker_pids()
    client.start()
    try:
        (worker,) = worker_pids() - before
        killed_at = time.monotonic()
        os.kill(client.core_pid, signal.SIGKILL)
        assert not wait_gone({worker}, 5), "a worker outlived its rank 0"
        print(f"\nrank 0 SIGKILL: its worker was gone {time.monotonic() - killed_at:.2f} s later")
    finally:
        client.stop(timeout=10)
    assert not wait_gone(worker_pids() - before, 10)
