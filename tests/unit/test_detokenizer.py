"""IncrementalDetokenizer against full decodes of a small byte-level BPE tokenizer.

The tokenizer is trained offline here (accents, em dash, CJK, emoji in the text, vocab ~500), so
many tokens are single bytes of multibyte characters: random token sequences split characters
and contain invalid UTF-8, the hard cases for streaming.
"""

from __future__ import annotations

import functools
import random
from itertools import pairwise

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from backend.engine.detokenizer import IncrementalDetokenizer

_SENTENCES = [
    "The café on the corner serves crème brûlée and piña colada — every day.",
    "Naïve façades in Zürich, São Paulo and Kraków look déjà vu to me.",
    "Streaming text must never split a character — not even an emoji like 🎉 or 🚀.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다。",
    "Ünïcödé wörds: ñandú, smörgåsbord, jalapeño, Ærøskøbing, Łódź.",
    "Emoji party: 😀😃😄😁 👍🏽 ❤️ 🇫🇷 — and the end.",
    "The quick brown fox jumps over the lazy dog; 1234567890 times!",
    "Prices: 5 € or 4 £ or ¥600, give or take — roughly.",
    "def hello(): return 'world'  # code also appears in prompts",
    "汉字和かなカナの混在テキスト、そして絵文字🍣🍜も。",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(120):
        words = " ".join(rng.sample(_SENTENCES, 3)).split(" ")
        rng.shuffle(words)
        lines.append(" ".join(words))
    return _SENTENCES * 5 + lines


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


def _stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Feeds ids in chunks split at ``cuts``; returns the deltas, finish() last."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    deltas = [detok.update(ids[a:b]) for a, b in pairwise(bounds)]
    deltas.append(detok.finish())
    return deltas


def _expected(full: str, stop: list[str]) -> tuple[str, str | None]:
    """Full decode truncated before the stop string completed first (earliest end, then start)."""
    best = None
    for s in stop:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return (full, None) if best is None else (full[: best[1]], best[2])


def test_tokenizer_splits_multibyte_characters() -> None:
    tok = make_tokenizer()
    assert 400 <= len(tok) <= 503
    ids = tok.encode("🎉 東京 — é", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some token is a partial character
    assert tok.decode(ids) == "🎉 東京 — é"


def test_simple_stream_matches_decode() -> None:
    tok = make_tokenizer()
    prompt = tok.encode("Emoji party:", add_special_tokens=False)
    out = tok.encode(" 😀 東京は — café 🇫🇷!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.update([t]) for t in out] + [detok.finish()]
    assert "".join(deltas) == tok.decode(out) == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert len([d for d in deltas if d]) > 5  # actually streams


def test_special_tokens_skipped_or_kept() -> None:
    tok = make_tokenizer()
    out = tok.encode("hello world", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=skip)
        text = "".join(detok.update([t]) for t in out) + detok.finish()
        assert text == tok.decode(out, skip_special_tokens=skip)
    assert text.endswith("</s>")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_tokens_deltas_join_to_full_decode(data) -> None:
    tok = make_tokenizer()
    vocab = len(tok)
    ids_st = st.lists(st.integers(0, vocab - 1), max_size=40)
    prompt = data.draw(ids_st, label="prompt")
    out = data.draw(ids_st, label="output")
    cuts = data.draw(st.lists(st.integers(0, 40), max_size=12), label="cuts")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    full = tok.decode(out, skip_special_tokens=skip)

    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(out))), len(out)]
    emitted = ""
    for a, b in pairwise(bounds):
        emitted += detok.update(out[a:b])
        # Every delta lands where the full decode has the same text: no premature U+FFFD.
        assert full.startswith(emitted)
        assert detok.text == emitted
    emitted += detok.finish()
    assert emitted == full == detok.text
    assert detok.stop_matched is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_are_excluded_across_deltas(data) -> None:
    tok = make_tokenizer()
    text = data.draw(st.sampled_from(_SENTENCES), label="text")
    out = tok.encode(text, add_special_tokens=False)
    # Stop strings cut from the text (so they match) plus one that never occurs.
    stop = []
    for _ in range(data.draw(st.integers(1, 3), label="num_stop")):
        i = data.draw(st.integers(0, len(text) - 1))
        n = data.draw(st.integers(1, 8))
        stop.append(text[i : i + n])
    stop.append(data.draw(st.sampled_from(["ZZZ", "— 🎉", "ééé"])))
    cuts = data.draw(st.lists(st.integers(0, len(out)), max_size=12), label="cuts")

    detok = IncrementalDetokenizer(tok, [], stop=stop)
    deltas = _stream(detok, out, cuts)
    want, want_stop = _expected(tok.decode(out), stop)
    assert "".join(deltas) == want == detok.text
    assert detok.stop_matched == want_stop
    assert all(s not in detok.text for s in stop)


def test_stop_string_spanning_tokens_and_deltas_stops_output() -> None:
    tok = make_tokenizer()
    out = tok.encode("The café on the corner — every day. More text after.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["— every"])
    deltas = []
    for t in out:
        deltas.append(detok.update([t]))
    deltas.append(detok.finish())
    assert detok.stop_matched == "— every"
    assert "".join(deltas) == "The café on the corner "
    # The stop string spans several tokens; nothing after it was ever emitted.
    assert detok.update(tok.encode(" more", add_special_tokens=False)) == ""
    assert detok.finish() == ""
    assert detok.text == "The café on the corner "


def test_held_back_prefix_is_released_by_finish() -> None:
    tok = make_tokenizer()
    out = tok.encode("see you at the caf", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["café!"])
    streamed = "".join(detok.update([t]) for t in out)
    assert streamed == "see you at the "  # "caf" could start "café!": held back
    assert detok.finish() == "caf"
    assert detok.text == "see you at the caf"
    assert detok.stop_matched is None


def test_partial_character_is_held_until_complete() -> None:
    tok = make_tokenizer()
    out = tok.encode("🚀", add_special_tokens=False)
    assert len(out) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.update([t]) for t in out] == [""] * (len(out) - 1) + ["🚀"]
    assert detok.finish() == ""


def test_finish_flushes_incomplete_character() -> None:
    tok = make_tokenizer()
    out = tok.encode("a🚀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.update([t]) for t in out) + detok.finish()
    assert text == tok.decode(out)
    assert text.endswith("\ufffd")


def test_window_stays_small() -> None:
    """Per-update cost is O(window): decode only ever sees a few tokens."""
    tok = make_tokenizer()
    out = tok.encode(" ".join(_SENTENCES * 3), add_special_tokens=False)

    class Counting:
        def __init__(self, inner):
            self.inner = inner
            self.max_len = 0

        def decode(self, ids, skip_special_tokens=False):
            self.max_len = max(self.max_len, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("prompt here", add_special_tokens=False))
    text = "".join(detok.update([t]) for t in out) + detok.finish()
    assert text == tok.decode(out)
    assert len(out) > 300
    assert counting.max_len <= 12
