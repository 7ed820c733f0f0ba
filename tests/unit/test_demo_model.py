"""The demo model builder is deterministic: two builds give byte-identical files."""

from __future__ import annotations

from backend.models.demo_model import DemoModelSpec, build, files_digest


def test_two_builds_are_byte_identical(tmp_path):
    spec = DemoModelSpec(num_hidden_layers=2, vocab_size=2048)  # smaller, same code path
    first = files_digest(build(tmp_path / "a", spec))
    second = files_digest(build(tmp_path / "b", spec))
    assert set(first) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert first == second


def test_an_existing_identical_build_is_kept(tmp_path):
    spec = DemoModelSpec(num_hidden_layers=1, vocab_size=1024)
    out = build(tmp_path / "m", spec)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    build(out, spec)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
