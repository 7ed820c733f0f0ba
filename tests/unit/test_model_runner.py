"""ModelRunner: the flattened batch it builds, greedy parity with transformers, chunked prefill."""

from __future__ import annotations

import pytest
import torch

from backend.engine.request import Request
from backend.models.loader import load_model
from backend.models.shape import ModelShape
from backend.protocol.sampling import SamplingParams
from backend.runner.model_runner import ModelRunner, allocate_kv_caches
from backend.runner.scheduled import ScheduledRequest as Scheduled
from tests.unit.random_models import get_random_model, reference_greedy, reference_logits

CPU = torch.device("cpu")


def _runner(name: str, block_size: int, num_blocks: int = 256):
    path, _ = get_random_model(name)
    model, hf_config = load_model(path, torch.float32, CPU)
    return ModelRunner(model, num_blocks, block_size), hf_config


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


class _TinyLoop:
    """A minimal engine: one token budget per step, decodes first, then prompt chunks.

    Blocks come from a shuffled free list, never freed (no prefix caching). Greedy sampling.
    """

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], max_tokens: int, eos: int | None,
                 token_budget: int | None, num_blocks: int):
        self.runner, self.max_tokens, self.eos, self.budget = runner, max_tokens, eos, token_budget
        self.requests = [Request(str(i), p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
        self.block_ids: list[list[int]] = [[] for _ in prompts]
        self.free = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        self.done = [False] * len(prompts)

    def _schedule(self, i: int, n: int) -> Scheduled:
        req, bs = self.requests[i], self.runner.block_size
        while len(self.block_ids[i]) * bs < req.num_computed_tokens + n:
            self.block_ids[i].append(self.free.pop())
        return Scheduled(req, n, req.num_computed_tokens, list(self.block_ids[i]))

    def step(self) -> None:
        budget = self.budget or 1 << 30
        scheduled = []
        remaining = [r.num_tokens - r.num_computed_tokens for r in self.requests]
        for i in sorted(range(len(self.requests)), key=lambda i: remaining[i] > 1):  # decodes first
            req = self.requests[i]
            if self.done[i] or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled.append(self._schedule(i, n))
            budget -= n
        logits, indices = self.runner.execute(scheduled)
        assert logits.shape == (len(indices), self.runner.vocab_size)
        for item in scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        for row, j in enumerate(indices):
            req = scheduled[j].request
            token = int(logits[row].argmax())
            req.append_output_token(token)
            i = int(req.request_id)
            if token == self.eos or req.num_output_tokens == self.max_tokens:
                self.done[i] = True

    def run(self) -> list[list[int]]:
        while not all(self.done):
            self.step()
        return [r.output_token_ids for r in self.requests]


@pytest.mark.parametrize(
    ("name", "block_size", "token_budget"),
    [
        ("llama_gqa4", 16, None),  # prefill everything in one step, then decode steps
        ("qwen2_tied", 12, None),
        ("llama3_mha", 7, None),
        ("llama_gqa4", 12, 96),  # chunked prefill mixed with decodes under a token budget
    ],
)
def test_greedy_tokens_match_transformers_generate(name, block_size, token_budget):
    runner, hf_config = _runner(name, block_size)
    max_tokens = 16
    prompts = _prompts(hf_config.vocab_size, [1, 2, 9, 31, 64, 100, 157, 200], seed=3)
    eos = hf_config.eos_token_id
    outputs = _TinyLoop(runner, prompts, max_tokens, eos, token_budget, num_blocks=256).run()
    for prompt, ours in zip(prompts, outputs, strict=True):
        assert ours == reference_greedy(name, tuple(prompt), max_tokens), f"prompt of {len(prompt)} tokens"


def test_chunked_prefill_gives_the_same_logits():
    runner, hf_config = _runner("llama3_mha", block_size=7)
    prompt = _prompts(hf_config.vocab_size, [100], seed=5)[0]
    whole, rows = runner.execute([Scheduled(Request("a", prompt, SamplingParams()), 100, 0, list(range(1, 16)))])
    assert rows == [0]
    chunked_req = Request("b", prompt, SamplingParams())
    blocks = list(range(100, 115))[::-1]
    computed = 0
    for chunk in (33, 40, 27):
        logits, rows = runner.execute([Scheduled(chunked_req, chunk, computed, blocks)])
        computed += chunk
        if computed < 100:
            assert rows == [] and logits.shape == (0, hf_config.vocab_size)  # nothing to sample yet
    assert rows == [0]
    torch.testing.assert_close(logits, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, reference_logits("llama3_mha", tuple(prompt))[-1:], atol=2e-4, rtol=1e-4)


def test_prepare_builds_the_flattened_batch():
    runner, _ = _runner("mistral_1kv", block_size=4, num_blocks=32)
    decode = Request("d", [5, 6, 7, 8, 9], SamplingParams())  # 4 cached, 1 new
    chunk = Request("c", list(range(10, 20)), SamplingParams())  # 3 cached, 4 new, not finished
    prompt = Request("p", [1, 2, 3], SamplingParams())
    scheduled = [
        Scheduled(decode, 1, 4, [7, 3]),
        Scheduled(chunk, 4, 3, [9, 2, 11]),  # a third block beyond the chunk: not needed yet
        Scheduled(prompt, 3, 0, [5]),
    ]
    input_ids, positions, md, rows, indices = runner.prepare(scheduled)
    assert input_ids.tolist() == [9, 13, 14, 15, 16, 1, 2, 3]
    assert positions.tolist() == [4, 3, 4, 5, 6, 0, 1, 2]
    assert md.slot_mapping.tolist() == [3 * 4 + 0, 9 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 20, 21, 22]
    assert md.block_tables.tolist() == [[7, 3], [9, 2], [5, 0]]
    assert md.block_tables.dtype == torch.int32 and md.slot_mapping.dtype == torch.int64
    assert md.seq_lens.tolist() == [5, 7, 3] and md.seq_lens_list == [5, 7, 3]
    assert md.query_start_loc.tolist() == [0, 1, 5, 8] and md.query_lens_list == [1, 4, 3]
    assert (md.max_query_len, md.max_seq_len, md.num_decodes) == (4, 7, 1)
    assert rows == [0, 7] and indices == [0, 2]


def test_execute_edge_cases():
    runner, hf_config = _runner("mistral_1kv", block_size=4, num_blocks=8)
    logits, indices = runner.execute([])
    assert logits.shape == (0, hf_config.vocab_size) and indices == []
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([Scheduled(Request("r", list(range(9)), SamplingParams()), 9, 0, [1, 2])])


def test_kv_cache_allocation_and_size():
    _, hf_config = _runner("llama_gqa4", block_size=16, num_blocks=2)
    shape = ModelShape.of(hf_config)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_size) == (4, 2, 32)
    caches = allocate_kv_caches(shape, 10, 16, torch.float32, CPU)
    assert len(caches) == 4
    assert all(k.shape == v.shape == (10, 16, 2, 32) and not k.any() for k, v in caches)
    # 4 layers x (K + V) x 16 tokens x 2 kv heads x 32 head_size x 4 bytes
    assert shape.kv_cache_bytes_per_block(16, torch.float32) == 4 * 2 * 16 * 2 * 32 * 4
    assert shape.kv_cache_bytes_per_block(16, torch.bfloat16) == 4 * 2 * 16 * 2 * 32 * 2


def test_loading_a_model_does_not_import_torch_dynamo():
    """A model's construction must not pull in torch._dynamo (most of a second of every engine
    start, and so of every stub recovery): nn.Embedding's random init on the meta device did."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    path, _ = get_random_model("llama_gqa4")
    code = ("import sys, torch\nfrom backend.models.loader import load_model\n"
            f"load_model({str(path)!r}, torch.float32, torch.device('cpu'))\n"
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout
