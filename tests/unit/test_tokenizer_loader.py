"""backend.engine.tokenizer.load_tokenizer gives exactly AutoTokenizer's class and token ids.

The demo model's tokenizer files are placed under each supported family's config.json (written by
transformers itself) with several tokenizer_config classes, and every prompt (digits, indented
code, non-ASCII text, special tokens) must tokenize and decode as AutoTokenizer's tokenizer does.
A Qwen2 folder is the case that broke: AutoTokenizer loads Qwen2Tokenizer there, whatever
tokenizer_config.json names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import transformers
from transformers.models.auto.tokenization_auto import (
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
    TOKENIZER_MAPPING_NAMES,
)

from backend.engine import tokenizer as loader
from backend.paths import REPO_ROOT
from backend.triton import tokenizer_model
from tests.unit.random_models import MODEL_SPECS, make_config

PROMPTS = [
    "def f(x):\n    return",
    " ".join(str(i) for i in range(1, 14)),
    "12345 + 678 = 13023, 3.14159",
    "class A:\n\tdef g(self):\n        if x:\n            return  [1,  2]\n",
    "Grüße aus München, naïve café — 東京で会いましょう 🙂",
    "<s>hello</s> world<pad>",
    "  leading spaces and trailing  ",
    "",
]
# tokenizer_config.json's tokenizer_class: None leaves it out (the class then comes from config.json).
HUB_CLASSES = ["TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2TokenizerFast",
               "GemmaTokenizerFast", None]


def family_folder(root, demo_model_dir, family: str, hub_class: str | None):
    folder = root / f"{family}-{hub_class}"
    folder.mkdir()
    shutil.copy(demo_model_dir / "tokenizer.json", folder)
    tokenizer_config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if hub_class is not None:
        tokenizer_config["tokenizer_class"] = hub_class
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    make_config(family).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", sorted(MODEL_SPECS))
def test_ids_equal_auto_tokenizer_for_every_family(tmp_path, demo_model_dir, family):
    for hub_class in HUB_CLASSES:
        folder = family_folder(tmp_path, demo_model_dir, family, hub_class)
        expected = transformers.AutoTokenizer.from_pretrained(folder)
        ours = loader.load_tokenizer(str(folder))
        assert type(ours) is type(expected), (family, hub_class)
        batched = tokenizer_model.load_tokenizer(str(folder), "/").backend_tokenizer  # the `tokenizer` model's
        for prompt in PROMPTS:
            ids = outcome(expected, prompt)
            assert outcome(ours, prompt) == ids, (family, hub_class, prompt)
            if isinstance(ids, list):
                assert ours.decode(ids) == expected.decode(ids), (family, hub_class, prompt)
                assert batched.encode_batch([prompt], add_special_tokens=True)[0].ids == ids
                without = expected(prompt, add_special_tokens=False)["input_ids"]
                assert batched.encode_batch([prompt], add_special_tokens=False)[0].ids == without
                assert batched.decode_batch([ids], skip_special_tokens=True) == [
                    expected.decode(ids, skip_special_tokens=True)]
        assert ours.all_special_ids == expected.all_special_ids


def outcome(tokenizer, prompt: str) -> list[int] | str:
    """The prompt's ids, or the error tokenizing it raised (GemmaTokenizer needs an <unk> that the
    demo vocabulary lacks: transformers' own tokenizer fails there, and ours must fail the same way)."""
    try:
        return tokenizer(prompt)["input_ids"]
    except Exception as error:  # noqa: BLE001 (any error, compared by its text)
        return f"{type(error).__name__}: {error}"


def test_qwen2_folders_load_qwen2_tokenizer_whatever_tokenizer_config_names(tmp_path, demo_model_dir):
    """The regression: Qwen2Tokenizer splits digits and indentation, so the ids differ from the raw file's."""
    folder = family_folder(tmp_path, demo_model_dir, "qwen2_tied", "TokenizersBackend")
    ours = loader.load_tokenizer(str(folder))
    assert type(ours).__name__ == "Qwen2Tokenizer"
    raw = transformers.TokenizersBackend.from_pretrained(folder)
    assert ours(PROMPTS[0])["input_ids"] != raw(PROMPTS[0])["input_ids"]
    assert ours(PROMPTS[1])["input_ids"] != raw(PROMPTS[1])["input_ids"]


def test_the_table_is_transformers_own():
    for model_type, name in loader.REGISTERED_CLASS.items():
        installed = TOKENIZER_MAPPING_NAMES.get(model_type)
        if name == loader.MISTRAL_COMMON:
            assert installed == loader._registered(model_type), model_type
        else:
            assert installed == name, model_type
        assert (model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) == (model_type in loader.HUB_CLASS_OVERRIDDEN)


def test_a_model_type_outside_the_table_goes_through_auto_tokenizer(tmp_path, demo_model_dir):
    folder = family_folder(tmp_path, demo_model_dir, "llama_gqa4", "TokenizersBackend")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    assert loader.auto_tokenizer_class(str(folder)) is None
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["x.Y", None]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert loader.auto_tokenizer_class(str(folder)) is None


def test_a_qwen2_folder_loads_without_torch(tmp_path, demo_model_dir):
    folder = family_folder(tmp_path, demo_model_dir, "qwen2_tied", "TokenizersBackend")
    code = textwrap.dedent(f"""
        import sys
        from backend.engine.tokenizer import load_tokenizer
        tokenizer = load_tokenizer({str(folder)!r})
        assert type(tokenizer).__name__ == "Qwen2Tokenizer", type(tokenizer)
        assert "torch" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=120)
