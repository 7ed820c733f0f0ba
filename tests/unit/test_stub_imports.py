"""With ``engine_process: true`` a Triton stub process imports no torch at all.

A fresh interpreter loads each model.py of model_repository as Triton does, imports every module
that their initialize()/execute() import with the engine core in its own process, loads the
tokenizers the front end loads (backend.engine.tokenizer.load_tokenizer, and the `tokenizer`
model's own), and must end with no ``torch`` in sys.modules. A second check keeps the module list
honest: every import made inside a function of those modules (the lazy ones) names a module of the
list, or one that only the ``engine_process: false`` path loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

import pytest

from backend.paths import REPO_ROOT

MODEL_FILES = [REPO_ROOT / "model_repository" / name / "1" / "model.py" for name in ("llm", "llm_iterative", "tokenizer")]

# What initialize() and execute() of the three models import with engine_process: true.
STUB_MODULES = (
    "backend.triton.llm_model",
    "backend.triton.iterative_model",
    "backend.triton.tokenizer_model",
    "backend.triton.tokenizer_chat",
    "backend.triton.engine_model",
    "backend.triton.admission",
    "backend.triton.helpers",
    "backend.triton.inputs",
    "backend.triton.metrics",
    "backend.triton.responder",
    "backend.triton.response_state",
    "backend.triton.sequence_responses",
    "backend.triton.return_outputs",
    "backend.triton.drain",
    "backend.triton.periodic",
    "backend.engine_core.engine_client",
    "backend.engine_core.make_client",
    "backend.engine_core.admission",
    "backend.engine_core.process_client",
    "backend.engine_core.step_on_demand",
    "backend.engine_core.process_handle",
    "backend.engine_core.stub_watch",
    "backend.engine_core.core",
    "backend.engine.input_processor",
    "backend.engine.tokenizer",
    "backend.lora.registry",
    "backend.config",
    "backend.protocol.sampling",
    "backend.protocol.outputs",
    "backend.protocol.messages",
    "backend.protocol.structured_output",
    "backend.protocol.kv_transfer",
)
# Imported inside functions of the modules above, and fine there: the stub's own module, and what
# only the engine_process: false branch (the engine in this process) or the tokenizers load.
LAZY_ELSEWHERE = {
    "triton_python_backend_utils",
    "backend.engine.llm_engine",
    "backend.engine_core.in_thread",
    "tokenizers",
    "transformers",
}

SCRIPT = textwrap.dedent("""
    import importlib, importlib.util, json, sys

    model_files, modules, tokenizer_dirs = json.loads(sys.argv[1])
    for index, path in enumerate(model_files):  # as Triton's stub loads a model.py
        spec = importlib.util.spec_from_file_location(f"triton_model_{index}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for name in modules:
        importlib.import_module(name)
    from backend.engine.tokenizer import load_tokenizer
    from backend.triton.tokenizer_model import load_tokenizer as load_fast_tokenizer
    for folder in tokenizer_dirs:
        load_tokenizer(folder)
        load_fast_tokenizer(folder, "/").backend_tokenizer.encode("x")
    print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
""")


@pytest.fixture(scope="module")
def tokenizer_dirs(demo_model_dir) -> list[str]:
    from backend.models.smollm2_model import build

    return [str(demo_model_dir), str(build())]  # the served model: made by make setup, a no-op then


def python_executable() -> str:
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.exists() else sys.executable


def test_a_stub_with_the_engine_in_its_own_process_imports_no_torch(tokenizer_dirs):
    argument = json.dumps([[str(path) for path in MODEL_FILES], list(STUB_MODULES), tokenizer_dirs])
    result = subprocess.run([python_executable(), "-c", SCRIPT, argument], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == [], f"the stub imported torch: {loaded[:5]}"


def is_module(name: str) -> bool:
    return (REPO_ROOT / (name.replace(".", "/") + ".py")).is_file()


def lazy_imports(module: str) -> set[str]:
    """The modules imported inside functions of ``module``'s source."""
    tree = ast.parse((REPO_ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]  # from package import module
                names.update([m for m in submodules if is_module(m)] or [node.module])
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return names


def test_every_lazy_import_of_the_stub_modules_is_checked_or_off_the_stubs_path():
    glue = [m for m in STUB_MODULES if m.startswith(("backend.triton.", "backend.engine_core."))]
    unchecked = {f"{module}: {name}" for module in glue for name in lazy_imports(module)
                 if name not in STUB_MODULES and name not in LAZY_ELSEWHERE}
    assert not unchecked, f"add these to STUB_MODULES (or LAZY_ELSEWHERE when the stub never runs them): {unchecked}"
