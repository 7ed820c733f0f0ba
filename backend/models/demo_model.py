"""Builds the demo model: a small random-weight Llama and a byte-level BPE tokenizer, offline.

No weights can be downloaded where this runs, so the demo model is made locally and
deterministically: the same inputs give byte-identical files. The tokenizer is trained on
``data/demo_corpus.txt`` (shipped with the repository); the weights come from a fixed seed with an
initialisation scaled so that logits are peaked (random weights otherwise give near-ties that make
greedy decoding flip on rounding noise).

It also writes ``models/demo-repository``: the served model repository (``llm``,
``llm_iterative``, ``tokenizer``) with only the model parameters changed to the demo model, so fast
tests and quick benchmarks run the very configuration users get, on the tiny model. It is rewritten
from ``model_repository`` on every run (a copy, byte-identical for the same inputs).

Usage: ``python -m backend.models.demo_model [--out models/demo-llama] [--force]``
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from backend.models.model_folder import parse_build_args, read_build_info, write_model_folder
from backend.paths import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "models" / "demo-llama"
CORPUS = REPO_ROOT / "data" / "demo_corpus.txt"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEMO_REPOSITORY = REPO_ROOT / "models" / "demo-repository"
DEMO_REPOSITORY_MODELS = ("llm", "llm_iterative", "tokenizer")
# Parameters of the served configs that the demo repository changes (paths relative to a model's
# folder, as in model_repository). The demo model's context is 4096; 2048 keeps tests quick;
# float32 keeps greedy tokens independent of how requests are batched, which the tests compare.
DEMO_PARAMETERS = {"model_dir": "../../demo-llama", "tokenizer_dir": "../../demo-llama", "max_model_len": "2048",
                   "dtype": "float32"}


@dataclass(frozen=True, slots=True)
class DemoModelSpec:
    """What the demo model is; part of build_info.json, so a changed spec triggers a rebuild."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2  # GQA ratio 4
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.2  # peaked logits: greedy parity without near-ties (as tests/unit/random_models.py)
    seed: int = 1234
    builder_version: int = 2


def train_tokenizer(vocab_size: int, model_max_length: int, corpus: Path = CORPUS):
    """A byte-level BPE tokenizer (bos/eos/pad) trained on the shipped corpus; returns a HF fast tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus.read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    tokenizer.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=model_max_length,
    )


def build_model(spec: DemoModelSpec):
    """The random-weight LlamaForCausalLM of ``spec`` (deterministic for a given seed)."""
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model


def files_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file in ``folder`` (the determinism check compares these)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def build(out: Path = DEFAULT_OUT, spec: DemoModelSpec = DemoModelSpec(), force: bool = False) -> Path:
    """Writes the demo model into ``out`` unless an identical build is already there."""
    out = Path(out)
    info = {"spec": asdict(spec), "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest()}
    built = read_build_info(out)
    if not force and built is not None and built.get("spec") == info["spec"] and (out / "model.safetensors").exists():
        return out
    print(f"building demo model into {out} (tokenizer, then weights)...", flush=True)
    model = build_model(spec)

    def write(staging: Path) -> None:
        train_tokenizer(spec.vocab_size, spec.max_position_embeddings).save_pretrained(staging)
        model.generation_config.do_sample = False
        model.save_pretrained(staging, safe_serialization=True)

    write_model_folder(out, write, info)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"demo model ready: {out} ({num_params / 1e6:.1f}M parameters)", flush=True)
    return out


def set_parameters(config_text: str, values: dict[str, str], insert_missing: bool = False) -> str:
    """config.pbtxt text with these ``parameters`` entries' string values replaced.

    A name the config does not have is inserted when ``insert_missing``, else left out (so the
    tokenizer model, which has no model_dir, is not given one).
    """
    for key, value in values.items():
        pattern = re.compile(r'(\{ key: "' + re.escape(key) + r'" value: \{ string_value: ")[^"]*("\s*\} \})')
        if pattern.search(config_text):
            config_text = pattern.sub(lambda m, v=value: m.group(1) + v + m.group(2), config_text)
        elif insert_missing:
            config_text = config_text.replace(
                "parameters [\n", f'parameters [\n  {{ key: "{key}" value: {{ string_value: "{value}" }} }},\n', 1)
    return config_text


def write_demo_repository(dest: Path = DEMO_REPOSITORY, source: Path = MODEL_REPOSITORY,
                          parameters: dict[str, str] = DEMO_PARAMETERS) -> Path:
    """Copies the served models of ``source`` into ``dest`` with the demo model's parameters."""
    dest = Path(dest)
    for name in DEMO_REPOSITORY_MODELS:
        target = dest / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source / name, target, ignore=shutil.ignore_patterns("__pycache__"))
        config = target / "config.pbtxt"
        config.write_text(set_parameters(config.read_text(), parameters))
    return dest


def main(argv: list[str] | None = None) -> int:
    args = parse_build_args("python -m backend.models.demo_model", __doc__.splitlines()[0], DEFAULT_OUT, argv)
    build(args.out, force=args.force)
    write_demo_repository()
    return 0


if __name__ == "__main__":
    sys.exit(main())
