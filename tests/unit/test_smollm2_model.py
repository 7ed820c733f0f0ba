"""The default model's build: deterministic, idempotent, and refusing a GGUF file that is not the expected one."""

from __future__ import annotations

import os

import pytest

from backend.models import smollm2_model
from backend.models.demo_model import files_digest


@pytest.fixture(scope="module")
def built():
    return smollm2_model.build()  # made by make setup; a no-op then


def test_a_second_conversion_gives_byte_identical_files(built, tmp_path):
    again = smollm2_model.build(tmp_path / "again", force=True)
    assert files_digest(again) == files_digest(built)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(files_digest(built))


def test_building_again_touches_nothing(built):
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert smollm2_model.build(built) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_a_gguf_file_with_another_hash_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / smollm2_model.GGUF_FILE
    fake.write_bytes(b"GGUF but not the one we expect")
    monkeypatch.setattr(smollm2_model, "gguf_path", lambda: fake)
    with pytest.raises(smollm2_model.ModelBuildError, match="sha256"):
        smollm2_model.build(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_saved_checkpoint_is_the_instruct_model_in_float32(built):
    import json

    config = json.loads((built / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] and config["dtype"] == "float32" and "quantization_config" not in config
    assert os.path.getsize(built / "model.safetensors") > 500e6  # float32, not re-quantized
