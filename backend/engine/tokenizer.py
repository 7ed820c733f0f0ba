"""Loading a checkpoint's tokenizer the same way in every process, without torch where possible.

``transformers.AutoTokenizer`` imports the model-config machinery, which imports torch: a Triton
stub process that only tokenizes would hold torch's few hundred MB for nothing. Folders whose
``tokenizer_config.json`` names a fast tokenizer class that transformers implements on the
``tokenizers`` library alone (``TokenizersBackend``, ``PreTrainedTokenizerFast``) are loaded with
that class directly, which is the class AutoTokenizer would pick for them; any other folder goes
through AutoTokenizer. The engine and the front end both call this, so a prompt gets the same
token ids whichever process tokenizes it.
"""

from __future__ import annotations

import json
import os

TORCH_FREE_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_class_name(folder: str) -> str | None:
    """The ``tokenizer_class`` of the folder's tokenizer_config.json, None when it names none."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_tokenizer(folder: str):
    """The folder's tokenizer, as AutoTokenizer would load it."""
    import transformers  # noqa: PLC0415

    name = tokenizer_class_name(folder)
    if name in TORCH_FREE_CLASSES:
        return getattr(transformers, name).from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)
