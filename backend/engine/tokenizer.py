"""Loading a checkpoint's tokenizer the same way in every process, without torch where possible.

``transformers.AutoTokenizer`` imports the model-config machinery, which imports torch: a Triton
stub process that only tokenizes would hold torch's few hundred MB for nothing. So the class is
decided here from the folder's JSON files by AutoTokenizer's own rule (transformers 5.24,
``AutoTokenizer.from_pretrained``), and that class is loaded directly: config.json's model type
names the class transformers registers for it, and for the model types whose published
tokenizer_config is known to be wrong (qwen2, phi3) that class wins over the one
tokenizer_config.json names. A Qwen2 folder whose tokenizer_config says ``TokenizersBackend`` is
loaded as ``Qwen2Tokenizer``, whose own digit and whitespace pre-tokenization gives other ids.
A folder this rule does not cover (a model type missing from the table below, remote code, a
Mistral ``tekken.json``) goes through AutoTokenizer itself. Every process that tokenizes or
renders chat calls ``load_tokenizer``, so a prompt gets the same ids whichever process reads it.
"""

from __future__ import annotations

import importlib.util
import json
import os

import transformers

# Classes transformers implements on the tokenizers library alone.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "PythonBackend")
MISTRAL_COMMON = "MistralCommonBackend"
# transformers' TOKENIZER_MAPPING_NAMES for the model types this engine serves (None: none
# registered, the folder's own class is used); tests/unit/test_tokenizer_loader.py checks it.
REGISTERED_CLASS: dict[str, str | None] = {
    "llama": None,
    "mistral": MISTRAL_COMMON,
    "mixtral": MISTRAL_COMMON,
    "qwen2": "Qwen2Tokenizer",
    "qwen2_moe": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "gemma3": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "phi3": "TokenizersBackend",
}
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS among them: the registered class wins.
HUB_CLASS_OVERRIDDEN = frozenset({"qwen2", "phi3"})


def _read_json(folder: str, name: str) -> dict:
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _registered(model_type: str) -> str | None:
    name = REGISTERED_CLASS[model_type]
    if name == MISTRAL_COMMON and importlib.util.find_spec("mistral_common") is None:
        return "TokenizersBackend"  # transformers registers the common backend only when installed
    return name


def _byte_level(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            return '"ByteLevel"' in f.read()
    except OSError:
        return False


def _known(name: str) -> str:
    """``name`` as transformers resolves a class name (``XFast`` is ``X`` in v5), else the generic class."""
    for candidate in (name.removesuffix("Fast"), name):
        if candidate not in ("PythonBackend", "PreTrainedTokenizer") and hasattr(transformers, candidate):
            return candidate
    return "TokenizersBackend"


def auto_tokenizer_class(folder: str) -> str | None:
    """The transformers class AutoTokenizer loads ``folder`` with, decided without torch; None
    where only AutoTokenizer itself can tell (see the module docstring)."""
    config = _read_json(folder, "config.json")
    tokenizer_config = _read_json(folder, "tokenizer_config.json")
    model_type = config.get("model_type")
    if "auto_map" in tokenizer_config or (model_type is not None and model_type not in REGISTERED_CLASS):
        return None
    hub = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    registered = _registered(model_type) if model_type else None
    if registered == MISTRAL_COMMON and os.path.exists(os.path.join(folder, "tekken.json")):
        return None
    if hub is None:
        if registered is None:
            return "TokenizersBackend"
        return "TokenizersBackend" if registered == MISTRAL_COMMON else _known(registered)
    overridden = model_type in HUB_CLASS_OVERRIDDEN
    if (hub.removesuffix("Fast") == "LlamaTokenizer" and registered != MISTRAL_COMMON and not overridden
            and _byte_level(folder)):
        return "TokenizersBackend"  # a Llama-3-style byte-level tokenizer.json under LlamaTokenizer's name
    if registered is not None and registered.removesuffix("Fast") != hub.removesuffix("Fast"):
        if registered not in (*GENERIC_CLASSES, MISTRAL_COMMON):
            chosen = _known(registered if overridden else hub)
            if chosen not in GENERIC_CLASSES:
                return chosen
        return "TokenizersBackend"
    return _known(hub)


def load_tokenizer(folder: str):
    """The folder's tokenizer, as AutoTokenizer would load it (the same class, so the same ids)."""
    name = auto_tokenizer_class(folder)
    if name is None:
        return transformers.AutoTokenizer.from_pretrained(folder)
    return getattr(transformers, name).from_pretrained(folder)
