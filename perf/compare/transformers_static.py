"""transformers ``generate()`` with request-level static batching, as perf.compare's ``hf-static``.

Requests are taken in arrival order in batches of ``batch_size``, left-padded and run to their
longest member (``min_new_tokens`` = ``max_new_tokens``, greedy), as request-level batching does;
only the tokens each request asked for count as output.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM


def run_static(model_dir: str, requests: list[tuple[list[int], int]], batch_size: int,
               dtype: str = "float32") -> dict:
    """``requests``: (prompt ids with BOS, forced output tokens) each, all offered at t=0.
    Returns {"output_tokens", "seconds"} (model load excluded)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    useful = 0
    start = time.perf_counter()
    num_batches = -(-len(requests) // batch_size)
    with torch.inference_mode():
        for first in range(0, len(requests), batch_size):
            batch = requests[first:first + batch_size]
            width = max(len(prompt) for prompt, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):  # left padding
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            longest = max(n for _, n in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
            useful += sum(n for _, n in batch)
            print(f"  static: batch {first // batch_size + 1}/{num_batches} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    return {"output_tokens": useful, "seconds": time.perf_counter() - start}
