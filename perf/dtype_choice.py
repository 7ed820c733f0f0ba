"""float32 against bfloat16 on the CPU, per model: greedy agreement with transformers in the same
dtype, the half of what ``dtype: auto`` is decided on (backend/models/loader.resolve_dtype) that no
other benchmark measures. The engine's greedy tokens (batched, as it serves) against transformers
``generate()`` in the same dtype, on ``--prompts`` prompts written for the repository
(data/demo_corpus.txt slices and chat prompts) of ``--max-tokens`` tokens each: the share of prompts
that are token-for-token equal, and of tokens before the first difference.

The other half, throughput, is perf.engine_settings' question for any parameter:

    .venv/bin/python -m perf.dtype_choice [--models smollm2,demo] [--prompts 16] [--max-tokens 48]
    .venv/bin/python -m perf.engine_settings --param dtype --values float32,bfloat16 --repeat 3 \
        [--model models/demo-repository/llm]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.engine.tokenizer import load_tokenizer
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from perf import engine_driver

MODELS = {  # name -> (model repository, model folder)
    "smollm2": (REPO_ROOT / "model_repository", REPO_ROOT / "models" / "smollm2-135m-instruct"),
    "demo": (REPO_ROOT / "models" / "demo-repository", REPO_ROOT / "models" / "demo-llama"),
}


def prompts(folder: Path, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(str(folder))  # as the engine loads it, from the model's folder
    corpus = (REPO_ROOT / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    texts = [corpus[i * 700 : i * 700 + 120 + 60 * (i % 5)] for i in range(count)]
    if tokenizer.chat_template:
        questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
                     "List three fruits.", "Say hello in French.", "What is 12 times 7?"]
        for i, question in enumerate(questions[: count // 3]):
            texts[i] = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                     add_generation_prompt=True)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def agreement(folder: Path, repository: Path, dtype: str, count: int, max_tokens: int) -> tuple[float, float]:
    """(share of prompts equal token for token, share of tokens before the first difference)."""
    ids = prompts(folder, count)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    want = []
    with torch.inference_mode():
        for prompt in ids:
            tensor = torch.tensor([prompt])
            out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    engine = LLMEngine(engine_config_from_model_folder(str(repository / "llm"), dtype=dtype))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    got = [record.token_ids for record in engine_driver.run(engine, [(prompt, params) for prompt in ids]).records]
    exact = sum(1 for a, b in zip(got, want, strict=True) if list(a) == list(b))
    prefix = 0
    for a, b in zip(got, want, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix += n
    return exact / len(ids), prefix / (len(ids) * max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.dtype_choice", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,demo")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        repository, folder = MODELS[name]
        for dtype in ("float32", "bfloat16"):
            exact, prefix = agreement(folder, repository, dtype, args.prompts, args.max_tokens)
            print(f"{name} {dtype}: {exact:.0%} of prompts equal to transformers, {prefix:.1%} of tokens before the "
                  f"first difference", flush=True)
            rows.append(f"| {name} | {dtype} | {exact:.0%} | {prefix:.1%} |")
    print(f"\n{args.prompts} prompts, {args.max_tokens} greedy tokens each\n\n"
          "| model | dtype | prompts equal to transformers (same dtype) | tokens before the first difference |\n"
          "| --- | --- | ---: | ---: |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
