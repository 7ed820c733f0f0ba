"""Prompts of an exact token count, built with the served model's tokenizer.

Lengths count tokens the way the server does: ``encode(text, add_special_tokens=True)``, so a
prompt built for 128 tokens comes back as ``num_input_tokens == 128`` (BOS included for Llama
tokenizers). Text is a random slice of a corpus (real words, so the tokenizer sees ordinary text)
cut at token boundaries, decoded, and re-encoded to check the count; a slice whose re-encoding
differs is replaced by another, so every returned prompt is verified.

Shared-prefix prompts are a system prompt of L tokens followed by a unique suffix; the full prompt
is checked to start with exactly the prefix's token ids, so the server's prefix cache can hit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from client.bench.metadata import CHECKOUT

DEFAULT_CORPUS = CHECKOUT / "data" / "demo_corpus.txt"
MAX_CORPUS_CHARS = 300_000  # plenty of distinct slices; keeps start-up short
MAX_ATTEMPTS = 64


class PromptError(ValueError):
    """No prompt of the requested length could be built."""


class PromptBuilder:
    """Builds token-exact prompts from a tokenizer folder and a text corpus."""

    def __init__(self, tokenizer_dir: str | Path, corpus_path: str | Path | None = None):
        tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
        if not tokenizer_file.exists():
            raise PromptError(f"{tokenizer_file} not found (build the demo model with `make setup`)")
        # AutoTokenizer's tokenizer, whose ids the server's loader gives exactly (backend/engine/tokenizer.py,
        # tests/unit/test_tokenizer_loader.py), through its Rust tokenizer's API.
        from transformers import AutoTokenizer  # noqa: PLC0415 (process: client.bench's runners import this module through workload; transformers, and torch with it, load only in a process that builds prompts)

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)).backend_tokenizer
        self.tokenizer_dir = str(tokenizer_dir)
        self.num_special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)
        corpus = self._read_corpus(corpus_path)
        self.corpus_ids = np.asarray(self.tokenizer.encode(corpus, add_special_tokens=False).ids, dtype=np.int64)
        if self.corpus_ids.size < 2:
            raise PromptError("the corpus has too few tokens to build prompts from")

    def _read_corpus(self, corpus_path: str | Path | None) -> str:
        path = Path(corpus_path) if corpus_path else DEFAULT_CORPUS
        if path.exists():
            return path.read_text(encoding="utf-8", errors="replace")[:MAX_CORPUS_CHARS]
        if corpus_path:
            raise PromptError(f"corpus {path} not found")
        # No corpus: the tokenizer's own word-like vocabulary, in a fixed order.
        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1])
        words = [self.tokenizer.decode([i]).strip() for _, i in vocab]
        return " ".join(w for w in words if w.isalpha()) * 4

    def count(self, text: str) -> int:
        """Tokens the server will count for ``text`` (special tokens included)."""
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def text_tokens(self, num_tokens: int, rng: np.random.Generator) -> str:
        """Text that encodes (without special tokens) to exactly ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return ""
        for _ in range(MAX_ATTEMPTS):
            start = int(rng.integers(0, self.corpus_ids.size))
            ids = np.take(self.corpus_ids, np.arange(start, start + num_tokens), mode="wrap").tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if len(self.tokenizer.encode(text, add_special_tokens=False).ids) == num_tokens:
                return text
        raise PromptError(f"no corpus slice re-encodes to {num_tokens} tokens in {MAX_ATTEMPTS} attempts")

    def prompt(self, num_tokens: int, rng: np.random.Generator) -> str:
        """A prompt the server counts as exactly ``num_tokens`` input tokens."""
        content = num_tokens - self.num_special_tokens
        if content < 1:
            raise PromptError(f"a prompt needs at least {self.num_special_tokens + 1} tokens, asked {num_tokens}")
        for _ in range(MAX_ATTEMPTS):
            text = self.text_tokens(content, rng)
            if self.count(text) == num_tokens:
                return text
        raise PromptError(f"no prompt of {num_tokens} tokens in {MAX_ATTEMPTS} attempts")

    def prompt_after_prefix(self, prefix: str, num_suffix_tokens: int, rng: np.random.Generator) -> str:
        """``prefix`` + a suffix of ``num_suffix_tokens``, keeping the prefix's token ids intact."""
        prefix_ids = self.tokenizer.encode(prefix, add_special_tokens=True).ids
        for _ in range(MAX_ATTEMPTS):
            full = prefix + self.text_tokens(num_suffix_tokens, rng)
            ids = self.tokenizer.encode(full, add_special_tokens=True).ids
            if len(ids) == len(prefix_ids) + num_suffix_tokens and ids[: len(prefix_ids)] == prefix_ids:
                return full
        raise PromptError(f"no suffix of {num_suffix_tokens} tokens keeps the prefix intact in {MAX_ATTEMPTS} attempts")
