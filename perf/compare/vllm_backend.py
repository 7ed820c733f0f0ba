"""Triton's own vLLM backend as a peer: vLLM's CPU build served by the tritonserver we serve with.

perf.compare's ``triton-vllm-backend`` system. The model is vllm_backend's ``src/model.py``
(github.com/triton-inference-server/vllm_backend, the commit ``VLLM_BACKEND_SHA``) with the utils it
imports, unchanged, fetched by ``make peer-vllm-backend`` into ``.peers/vllm_backend/<sha>/`` (never
into this tree). It runs on the vLLM of ``make peers`` (``.peers/vllm``) inside the same
tritonserver 2.51 binary, launcher and load generator as our ``triton`` system: gRPC streaming
through client.bench, so the two differ only in the model behind Triton.

Each run writes a model repository (kept under the run's out dir) holding ``vllm_model``:

* ``config.pbtxt``: the Python backend (vllm_backend's own ``backend: "vllm"`` needs
  ``backends/vllm/model.py`` beside the server, which the wheel's server does not have), its
  decoupled transaction policy, ``max_batch_size: 0`` and the inputs and outputs its
  ``auto_complete_config`` declares (each [1] input taken as the [1, 1] our client sends and
  reshaped to [1] by Triton: without it Triton refuses our requests, "unexpected shape for input
  ... Expected [1], got [1,1]", measured), and ``EXECUTION_ENV_PATH`` = ``.peers/vllm``: the Python
  backend then starts the stub in that venv (its ``bin/activate``), so the stub's sys.path holds
  vLLM's site-packages and none of ours (measured: with our venv's site-packages ahead of it,
  ``transformers`` from vLLM's venv picked up our ``accelerate``, which fails against the other
  numpy). That venv must be the stub's Python version (3.11, the one stub we copy).
* ``numpy-overlay/``: vLLM's venv has numpy 2, and the 2.51 stub crashes on the first BYTES input
  under numpy 2 (``unpack_from requires a buffer of at least 1061109571 bytes ... (actual buffer
  size is 67)`` in triton_python_backend_utils.deserialize_bytes_tensor, the stub then "not
  healthy"; measured with a five-line echo model: numpy 2.3.5 in the stub crashes in either venv,
  numpy 1.26.4 works in both). The stub builds the uint8 array it hands to that function with its
  own pybind11, evidently of numpy 1's ABI. So the overlay links our venv's numpy 1.26 (package,
  dist-info, libraries), and the wrapper puts it ahead of vLLM's site-packages: vLLM, torch and
  the rest come from vLLM's venv, numpy from ours (torch and vLLM's extensions built against numpy
  2 load on 1.x, numpy's backward-compatible ABI).
* ``1/model.py``: a wrapper we generate (``wrapper_source``): it checks the stub's sys.path (and,
  on a backend that ignored EXECUTION_ENV_PATH, swaps our site-packages for vLLM's before anything
  is imported), puts the numpy overlay first, sets the UTF-8 locale our own models set (the stub's
  Python reads files as ASCII: vLLM's import then fails in torch._inductor's template loader),
  binds the pinned source's ``utils`` folder as the ``utils`` package its imports name, applies
  the shims ``SHIMS`` lists for names vLLM 0.32 moved, and re-exports the pinned file's
  ``TritonPythonModel``.
* ``1/model.json``: the engine arguments of our ``vllm`` system (perf.compare.vllm_server: the same
  model folder, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, seed 0; its ``default`` setup's
  VLLM_CPU_KVCACHE_SPACE and offline environment go to the server's environment).

vllm_backend reads no ``max_tokens`` or ``ignore_eos`` tensors: every request carries them in its
``sampling_parameters`` JSON (greedy, like the OpenAI client's requests to the ``vllm`` system),
with ``return_num_input_tokens`` and ``return_num_output_tokens`` so the counts are the server's
own (the client sums the per-response counts: vllm_backend sends no token ids).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path

import numpy

from backend.paths import REPO_ROOT
from backend.server.launcher import LauncherError, start_server
from backend.triton.helpers import set_utf8_locale
from client.bench.arrivals import ArrivalPattern
from client.bench.progress import Progress
from client.bench.runner import run_workload
from client.bench.triton_clients import run_triton_workload
from perf.compare import vllm_server
from perf.compare.cpu_meter import CpuMeter
from perf.idle_cpu import wait_until_quiet

VLLM_BACKEND_REPO = "triton-inference-server/vllm_backend"
# main on 2026-01-09, "fix: Custom build_async_engine_client_from_engine_args (#118)"; the Makefile's
# VLLM_BACKEND_SHA must be the same (tests/unit/test_vllm_backend_peer.py checks).
VLLM_BACKEND_SHA = "8de0c148bda1da25de1e05ffaaf67116dacc7264"
VLLM_BACKEND_FILES = ("model.py", "utils/metrics.py", "utils/request.py", "utils/vllm_backend_utils.py")  # under src/
DEFAULT_SOURCE_ROOT = REPO_ROOT / ".peers" / "vllm_backend"
MODEL_NAME = "vllm_model"
RESULT_NAME = "Triton vllm_backend, vLLM CPU (gRPC streaming)"

# vllm_backend's auto_complete_config inputs and outputs at the pinned commit: (name, type, dims, optional).
INPUTS = (
    ("text_input", "TYPE_STRING", (1,), False),
    ("image", "TYPE_STRING", (-1,), True),
    ("stream", "TYPE_BOOL", (1,), True),
    ("sampling_parameters", "TYPE_STRING", (1,), True),
    ("exclude_input_in_output", "TYPE_BOOL", (1,), True),
    ("return_finish_reason", "TYPE_BOOL", (1,), True),
    ("return_cumulative_logprob", "TYPE_BOOL", (1,), True),
    ("return_logprobs", "TYPE_BOOL", (1,), True),
    ("return_num_input_tokens", "TYPE_BOOL", (1,), True),
    ("return_num_output_tokens", "TYPE_BOOL", (1,), True),
    ("embedding_request", "TYPE_STRING", (1,), True),
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", (-1,)),
    ("finish_reason", "TYPE_STRING", (-1,)),
    ("cumulative_logprob", "TYPE_FP32", (-1,)),
    ("logprobs", "TYPE_STRING", (-1,)),
    ("num_input_tokens", "TYPE_UINT32", (1,)),
    ("num_output_tokens", "TYPE_UINT32", (-1,)),
)

# What the pinned files import that vLLM 0.32 moved (found by importing them against .peers/vllm):
# (the module the pinned file names, the name, the module that has it now).
SHIMS = (
    ("vllm.inputs.data", "TokensPrompt", "vllm.inputs"),  # utils/request.py; vllm/inputs/data.py is gone
    ("vllm.v1.metrics.loggers", "build_1_2_5_buckets", "vllm.v1.metrics.buckets"),  # utils/metrics.py
)


class VllmBackendError(RuntimeError):
    """The triton-vllm-backend system cannot run here; the message says why."""


def backend_source(sha: str = VLLM_BACKEND_SHA, root: Path = DEFAULT_SOURCE_ROOT) -> Path:
    """``root/sha``, holding every pinned file (``make peer-vllm-backend`` puts them there)."""
    folder = Path(root) / sha
    missing = [name for name in VLLM_BACKEND_FILES if not (folder / name).is_file()]
    if missing:
        raise VllmBackendError(
            f"vllm_backend {sha[:12]} is not in {folder} (missing {', '.join(missing)}): run `make peer-vllm-backend` "
            f"(or `make peer-vllm-backend VLLM_BACKEND_SRC=/path/to/vllm_backend/.git` without GitHub access)")
    return folder


def site_packages(venv: Path, version: tuple[int, int] = sys.version_info[:2]) -> Path:
    """The venv's site-packages for Python ``version`` (the stub's: ours, since the launcher copies the
    stub built for the interpreter it runs in); a clear error when the venv is another Python."""
    folder = Path(venv) / "lib" / f"python{version[0]}.{version[1]}" / "site-packages"
    if not folder.is_dir():
        found = sorted(p.name for p in (Path(venv) / "lib").glob("python3*"))
        raise VllmBackendError(
            f"{venv} has no {folder.relative_to(venv)} (it has {found or 'no lib/python3.*'}): the Python backend stub "
            f"is built for Python {version[0]}.{version[1]}, so vLLM must be installed for that Python (`make peers`)")
    return folder


def engine_arguments(model_dir: str, dtype: str, max_model_len: int, max_num_seqs: int, seed: int = 0,
                     max_num_batched_tokens: int | None = None) -> dict:
    """model.json: the engine arguments perf.compare.vllm_server gives the ``vllm`` system's API server
    (``max_num_batched_tokens`` None: vLLM's own default)."""
    arguments = {"model": str(model_dir), "dtype": dtype, "max_model_len": int(max_model_len),
                 "max_num_seqs": int(max_num_seqs), "seed": int(seed)}
    if max_num_batched_tokens is not None:
        arguments["max_num_batched_tokens"] = int(max_num_batched_tokens)
    return arguments


def _dims(dims: tuple[int, ...]) -> str:
    return ", ".join(str(d) for d in dims)


def _input_line(name: str, kind: str, dims: tuple[int, ...], optional: bool) -> str:
    """One input; a [1] one takes the [1, 1] our client sends (client.stream.build_inputs: the batch
    dimension our ``llm`` model's max_batch_size needs) and Triton reshapes it to the [1] vllm_backend
    reads (``as_numpy()[0]`` is then the value), as its own clients send it."""
    shape = f"dims: [ {_dims(dims)} ]" if dims != (1,) else "dims: [ 1, 1 ] reshape: { shape: [ 1 ] }"
    return f'  {{ name: "{name}" data_type: {kind} {shape}{" optional: true" if optional else ""} }}'


def config_pbtxt(venv: Path, sha: str = VLLM_BACKEND_SHA) -> str:
    """vllm_model's config.pbtxt (see the module docstring)."""
    inputs = ",\n".join(_input_line(*spec) for spec in INPUTS)
    outputs = ",\n".join(f'  {{ name: "{name}" data_type: {kind} dims: [ {_dims(dims)} ] }}'
                         for name, kind, dims in OUTPUTS)
    return f"""# Written by perf.compare.vllm_backend: Triton's vLLM backend ({VLLM_BACKEND_REPO} src/model.py at
# {sha}) as a Python-backend model, in the venv of vLLM's CPU build.
name: "{MODEL_NAME}"
backend: "python"
max_batch_size: 0

model_transaction_policy {{
  decoupled: true
}}

instance_group [
  {{
    count: 1
    kind: KIND_MODEL
  }}
]

input [
{inputs}
]

output [
{outputs}
]

parameters [
  {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{Path(venv).resolve()}" }} }}
]
"""


WRAPPER_TEMPLATE = '''"""Written by perf.compare.vllm_backend for one run: Triton's vLLM backend, unchanged.

{repo} src/model.py at {sha} (from {source}) on vLLM's CPU build in {venv}.
"""

import importlib
import importlib.machinery
import importlib.util
import locale
import os
import sys

VLLM_BACKEND_SHA = {sha!r}
VLLM_BACKEND_SOURCE = {source!r}
VLLM_SITE_PACKAGES = {site!r}
NUMPY_OVERLAY = {overlay!r}
SHIMS = {shims!r}


def _use_vllm_site_packages():
    """config.pbtxt's EXECUTION_ENV_PATH starts the stub in vLLM's venv; a backend that ignored it
    left our venv's site-packages on sys.path: swap them for vLLM's before anything imports (a mix
    of the two venvs does not import)."""
    if VLLM_SITE_PACKAGES not in sys.path:
        ours = [i for i, p in enumerate(sys.path) if p.endswith("site-packages") or p.startswith("__editable__")]
        at = ours[0] if ours else len(sys.path)
        sys.path[:] = [p for i, p in enumerate(sys.path) if i not in ours]
        sys.path.insert(at, VLLM_SITE_PACKAGES)
    if NUMPY_OVERLAY is not None:
        # The 2.51 stub's BYTES tensors break under numpy 2 (perf/compare/vllm_backend.py says how):
        # numpy 1.x from this folder, ahead of the venv's numpy 2.
        if "numpy" in sys.modules:
            raise ImportError(f"numpy {{sys.modules['numpy'].__version__}} was imported before the wrapper could "
                              f"put the numpy of {{NUMPY_OVERLAY}} first")
        sys.path.insert(0, NUMPY_OVERLAY)


# Our models' own (backend/triton/helpers.py, copied in): without it vLLM's import fails in
# torch._inductor's template loader (UnicodeDecodeError: 'ascii' codec can't decode byte 0xe2, measured).
{set_utf8_locale}

def _bind_utils_package():
    """model.py imports ``utils.metrics``, ``utils.request``, ``utils.vllm_backend_utils`` (a folder
    beside it, no __init__.py): bind ``utils`` to that folder, whatever else is called utils."""
    spec = importlib.machinery.ModuleSpec("utils", None, is_package=True)
    spec.submodule_search_locations = [os.path.join(VLLM_BACKEND_SOURCE, "utils")]
    sys.modules["utils"] = importlib.util.module_from_spec(spec)


def _apply_shims():
    """Names the pinned files import from where vLLM no longer has them; returns what was shimmed."""
    applied = []
    for module_name, name, new_home in SHIMS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            parent, _, child = module_name.rpartition(".")
            spec = importlib.machinery.ModuleSpec(module_name, None)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            setattr(importlib.import_module(parent), child, module)
        if not hasattr(module, name):
            setattr(module, name, getattr(importlib.import_module(new_home), name))
            applied.append(f"{{module_name}}.{{name}} = {{new_home}}.{{name}}")
    return applied


def _load_pinned_model():
    _use_vllm_site_packages()
    set_utf8_locale()
    _bind_utils_package()
    try:
        import vllm
    except Exception as exc:
        raise ImportError(f"vLLM does not import in the stub (Python {{sys.version.split()[0]}}, "
                          f"sys.path {{sys.path}}): {{type(exc).__name__}}: {{exc}}") from exc
    applied = _apply_shims()
    path = os.path.join(VLLM_BACKEND_SOURCE, "model.py")
    spec = importlib.util.spec_from_file_location("vllm_backend_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ImportError(f"vllm_backend {{VLLM_BACKEND_SHA[:12]}} model.py does not import on vLLM "
                          f"{{vllm.__version__}} (shims applied: {{applied}}): {{type(exc).__name__}}: {{exc}}") from exc
    import numpy
    print(f"vllm_backend {{VLLM_BACKEND_SHA}} on vLLM {{vllm.__version__}} from {{os.path.dirname(vllm.__file__)}}, "
          f"numpy {{numpy.__version__}} from {{os.path.dirname(numpy.__file__)}}; shims: {{applied or 'none'}}", flush=True)
    return module.TritonPythonModel


TritonPythonModel = _load_pinned_model()
'''


def wrapper_source(source: Path, venv: Path, site: Path, sha: str = VLLM_BACKEND_SHA,
                   numpy_overlay: Path | None = None) -> str:
    """vllm_model/1/model.py (see the module docstring)."""
    overlay = None if numpy_overlay is None else str(Path(numpy_overlay).resolve())
    return WRAPPER_TEMPLATE.format(repo=VLLM_BACKEND_REPO, sha=sha, source=str(Path(source).resolve()),
                                   venv=str(Path(venv).resolve()), site=str(Path(site).resolve()), shims=SHIMS,
                                   overlay=overlay, set_utf8_locale=inspect.getsource(set_utf8_locale))


def installed_version(site: Path, distribution: str) -> str | None:
    """The version of ``distribution`` installed in ``site`` (its dist-info folder's name), or None."""
    found = sorted(Path(site).glob(f"{distribution}-*.dist-info"))
    return found[0].name[len(distribution) + 1:-len(".dist-info")] if found else None


def numpy_overlay(destination: Path, site: Path) -> Path | None:
    """``destination/numpy-overlay``: links to this interpreter's numpy 1.x (package, dist-info and
    bundled libraries: the numpy our own models' stubs run), written when ``site`` has numpy 2 (the
    2.51 stub cannot pass BYTES tensors to numpy 2); None when ``site``'s numpy is 1.x already."""
    theirs = installed_version(site, "numpy")
    if theirs is None or int(theirs.split(".")[0]) < 2:
        return None

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise VllmBackendError(f"{site} has numpy {theirs} and so has this interpreter ({numpy.__version__}): the "
                               "2.51 Python backend stub passes BYTES tensors only to numpy 1.x")
    ours = Path(numpy.__file__).resolve().parent.parent
    overlay = Path(destination) / "numpy-overlay"
    overlay.mkdir(parents=True, exist_ok=True)
    for name in ("numpy", f"numpy-{numpy.__version__}.dist-info", "numpy.libs"):
        if (ours / name).exists():
            link = overlay / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(ours / name, target_is_directory=True)
    return overlay


def model_json(repository: Path) -> Path:
    """Where write_repository puts the engine arguments (vllm_backend reads them from its version folder)."""
    return Path(repository) / MODEL_NAME / "1" / "model.json"


def write_repository(destination: Path, model_dir: str, dtype: str, max_model_len: int, max_num_seqs: int,
                     venv: Path, source: Path, sha: str = VLLM_BACKEND_SHA, seed: int = 0,
                     max_num_batched_tokens: int | None = None) -> Path:
    """Writes ``destination/vllm_model`` (config.pbtxt, 1/model.py, 1/model.json, and numpy-overlay
    where ``numpy_overlay`` needs one); returns ``destination``."""
    site = site_packages(venv)
    version_dir = model_json(destination).parent
    version_dir.mkdir(parents=True, exist_ok=True)
    overlay = numpy_overlay(version_dir.parent, site)
    (version_dir.parent / "config.pbtxt").write_text(config_pbtxt(venv, sha), encoding="utf-8")
    (version_dir / "model.py").write_text(wrapper_source(source, venv, site, sha, overlay), encoding="utf-8")
    arguments = engine_arguments(model_dir, dtype, max_model_len, max_num_seqs, seed, max_num_batched_tokens)
    model_json(destination).write_text(json.dumps(arguments, indent=2) + "\n", encoding="utf-8")
    return Path(destination)


def backend_items(items):
    """The workload's forced-length requests in vllm_backend's inputs: max_tokens and ignore_eos in
    ``sampling_parameters`` (greedy), no ``max_tokens`` tensor (None: client.bench sends none), the
    server's token counts requested."""
    converted = []
    for item in items:
        if item.inputs is not None:
            raise ValueError("triton-vllm-backend sends forced-length prompts only (WorkItem.inputs is our llm's)")
        sampling = {"max_tokens": int(item.max_tokens), "ignore_eos": True, "temperature": 0.0}
        converted.append(dataclasses.replace(item, inputs={
            "max_tokens": None, "sampling_parameters": json.dumps(sampling), "exclude_input_in_output": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True}))
    return converted


def failure_reason(log_text: str, limit: int = 5000) -> str:
    """The part of a tritonserver log that says why the model did not load: its last Python
    traceback (the stub's), else the lines that name an error, else the log's end."""
    start = log_text.rfind("Traceback (most recent call last)")
    if start >= 0:
        return log_text[start:start + limit]
    lines = [line for line in log_text.splitlines() if "rror" in line or "failed" in line.lower()]
    return "\n".join(lines)[-limit:] if lines else log_text[-limit:]


def run_vllm_backend(args, runs, warmup, load_before: float, model_dir: str, max_model_len: int,
                     max_num_seqs: int, max_num_batched_tokens: int | None = None) -> tuple[list, dict]:
    """Like perf.compare's run_triton: every (pattern, items) of ``runs`` on one tritonserver serving
    vllm_model; per run (completed, duration, CpuMeter, None, load average at its start), and what
    the report records of the system."""
    source = backend_source()
    venv = vllm_server.DEFAULT_VLLM_VENV
    try:
        python = vllm_server.vllm_python(venv)
    except FileNotFoundError as exc:
        raise VllmBackendError(str(exc)) from None
    out_dir = Path(args.out_dir)
    repository = write_repository(out_dir / "triton-vllm-backend-repository", model_dir, args.dtype, max_model_len,
                                  max_num_seqs, venv, source, seed=0, max_num_batched_tokens=max_num_batched_tokens)
    ours = vllm_server.setup_environment("default", args.vllm_kv_cache_gib, venv)
    env = {**os.environ, **ours, **vllm_server.offline_environment(python)}
    log_path = out_dir / "tritonserver-vllm-backend.log"
    log_path.unlink(missing_ok=True)
    info = {"vllm_backend": {"repo": VLLM_BACKEND_REPO, "sha": VLLM_BACKEND_SHA, "source": str(source)},
            "versions": vllm_server.vllm_version(venv), "env": ours, "shims": [f"{m}.{n} from {h}" for m, n, h in SHIMS],
            "engine_args": json.loads(model_json(repository).read_text(encoding="utf-8")),
            "repository": str(repository), "log": str(log_path)}
    overlay = repository / MODEL_NAME / "numpy-overlay"
    info["numpy_overlay"] = str(overlay.resolve()) if overlay.exists() else None  # the stub's numpy, when linked
    print(f"starting tritonserver with vllm_backend {VLLM_BACKEND_SHA[:12]} on vLLM {info['versions'].get('vllm')}...",
          flush=True)
    try:
        server = start_server(repository, log_path=log_path, ready_timeout=900.0, env=env)
    except LauncherError as exc:
        text = log_path.read_text(errors="replace") if log_path.exists() else str(exc)
        raise VllmBackendError(f"tritonserver did not load {MODEL_NAME} (vllm_backend {VLLM_BACKEND_SHA[:12]}, vLLM "
                               f"{info['versions'].get('vllm')}); log {log_path}:\n{failure_reason(text)}") from None
    measured = []
    try:
        done, _ = run_workload(server.grpc_url, MODEL_NAME, backend_items(warmup), ArrivalPattern("concurrency", 1))
        if done[0].record.error:
            raise VllmBackendError(f"the warm-up request failed: {done[0].record.error}; log {log_path}")
        wait_until_quiet(server.process.pid)
        for index, (pattern, items) in enumerate(runs):
            load = load_before if index == 0 else os.getloadavg()[0]
            cpu = CpuMeter(server.process.pid)
            with Progress(f"triton-vllm-backend {pattern.label}", len(items), args.progress_interval) as progress:
                completed, duration = run_triton_workload(server.grpc_url, MODEL_NAME, backend_items(items), pattern,
                                                          args.triton_client, seed=args.seed, progress=progress)
            cpu.stop()
            measured.append((completed, duration, cpu, None, load))
    finally:
        server.stop()
    return measured, info
