"""perf.compare's triton-vllm-backend system without vLLM: the Makefile's copy of the pinned files,
the generated config.pbtxt / model.py wrapper / model.json, the requests, and how the client counts
vllm_backend's tokens (it sends no ids)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend.config import parameters_from_pbtxt
from backend.paths import REPO_ROOT
from client.bench.workload import WorkItem
from client.stream import StreamResult, build_inputs, read_response
from perf.compare import vllm_backend as vb
from perf.compare.__main__ import ALL_SYSTEMS, DEFAULT_SYSTEMS

PINNED = vb.DEFAULT_SOURCE_ROOT / vb.VLLM_BACKEND_SHA


def _make_variable(name: str) -> str:
    match = re.search(rf"^{name} [?:]?= *(.*)$", (REPO_ROOT / "Makefile").read_text(), flags=re.M)
    assert match, f"Makefile has no {name}"
    return match.group(1).strip()


def test_system_is_listed_but_not_default():
    assert "triton-vllm-backend" in ALL_SYSTEMS
    assert "triton-vllm-backend" not in DEFAULT_SYSTEMS


def test_makefile_pins_the_same_commit_and_files():
    assert _make_variable("VLLM_BACKEND_SHA") == vb.VLLM_BACKEND_SHA
    assert re.fullmatch(r"[0-9a-f]{40}", vb.VLLM_BACKEND_SHA)
    assert tuple(_make_variable("VLLM_BACKEND_FILES").split()) == vb.VLLM_BACKEND_FILES
    peers_target = re.search(r"^peers: (.*)$", (REPO_ROOT / "Makefile").read_text(), flags=re.M).group(1)
    assert "vllm_backend" not in peers_target.lower() and "VLLM_BACKEND" not in peers_target


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_copies_the_pinned_files_from_a_git_dir(tmp_path):
    upstream = tmp_path / "vllm_backend"
    (upstream / "src" / "utils").mkdir(parents=True)
    for name in vb.VLLM_BACKEND_FILES:
        (upstream / "src" / name).write_text(f"# {name} at the pinned commit\n")
    (upstream / "README.md").write_text("not copied\n")
    _git("init", "-q", cwd=upstream)
    _git("add", ".", cwd=upstream)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "pinned", cwd=upstream)
    sha = _git("rev-parse", "HEAD", cwd=upstream)
    (upstream / "src" / "model.py").write_text("# a later commit\n")
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "later", cwd=upstream)

    peers = tmp_path / "peers"
    command = ["make", "-s", "-C", str(REPO_ROOT), "peer-vllm-backend", f"PEERS={peers}", f"VLLM_BACKEND_SHA={sha}",
               f"VLLM_BACKEND_SRC={upstream / '.git'}"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    target = peers / "vllm_backend" / sha
    for name in vb.VLLM_BACKEND_FILES:
        assert (target / name).read_text() == f"# {name} at the pinned commit\n"
    assert not (target / "README.md").exists()
    assert (target / ".complete").exists() and not Path(f"{target}.partial").exists()
    assert vb.backend_source(sha, peers / "vllm_backend") == target

    bad = subprocess.run([*command[:-2], "VLLM_BACKEND_SHA=" + "0" * 40, f"VLLM_BACKEND_SRC={upstream / '.git'}"],
                         capture_output=True, text=True)
    assert bad.returncode != 0
    assert not (peers / "vllm_backend" / ("0" * 40)).exists()


def test_missing_source_names_the_make_target(tmp_path):
    with pytest.raises(vb.VllmBackendError, match="make peer-vllm-backend"):
        vb.backend_source(vb.VLLM_BACKEND_SHA, tmp_path)


def test_venv_of_another_python_is_refused(tmp_path):
    (tmp_path / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    with pytest.raises(vb.VllmBackendError, match="built for Python 3.11"):
        vb.site_packages(tmp_path, (3, 11))


def test_config_pbtxt():
    text = vb.config_pbtxt(Path("/opt/peers/vllm"))
    assert 'name: "vllm_model"' in text and 'backend: "python"' in text
    assert re.search(r"model_transaction_policy \{\s*decoupled: true\s*\}", text)
    assert "max_batch_size: 0" in text
    assert parameters_from_pbtxt(text)["EXECUTION_ENV_PATH"] == "/opt/peers/vllm"
    for name, kind, dims, optional in vb.INPUTS:
        line = next(line for line in text.splitlines() if f'name: "{name}"' in line)
        assert f"data_type: {kind}" in line and ("optional: true" in line) == optional
        if dims == (1,):  # our client's [1, 1], reshaped to vllm_backend's [1]
            assert "dims: [ 1, 1 ] reshape: { shape: [ 1 ] }" in line
        else:
            assert "reshape" not in line
    for name, kind, _ in vb.OUTPUTS:
        assert re.search(rf'name: "{name}" data_type: {kind}', text)


@pytest.mark.skipif(not (PINNED / "model.py").exists(), reason="make peer-vllm-backend not run")
def test_inputs_and_outputs_are_the_pinned_auto_complete_ones():
    tree = ast.parse((PINNED / "model.py").read_text())
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                    and n.name == "_auto_complete_inputs_and_outputs")
    lists = {node.targets[0].id: ast.literal_eval(node.value) for node in function.body
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
             and node.targets[0].id in ("inputs", "outputs")}
    assert [(i["name"], i["data_type"], tuple(i["dims"]), i.get("optional", False)) for i in lists["inputs"]] == \
        list(vb.INPUTS)
    assert [(o["name"], o["data_type"], tuple(o["dims"])) for o in lists["outputs"]] == list(vb.OUTPUTS)


def test_engine_arguments_are_the_vllm_systems():
    assert vb.engine_arguments("/m", "float32", 8192, 64) == {
        "model": "/m", "dtype": "float32", "max_model_len": 8192, "max_num_seqs": 64, "seed": 0}
    assert vb.engine_arguments("/m", "bfloat16", 8192, 64, max_num_batched_tokens=2048)["max_num_batched_tokens"] == 2048


def _fake_venv(root: Path, numpy_version: str | None) -> Path:
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    if numpy_version:
        (site / f"numpy-{numpy_version}.dist-info").mkdir()
    return site


def test_write_repository(tmp_path):
    venv, source = tmp_path / "venv", tmp_path / "source"
    _fake_venv(venv, "2.3.5")
    repository = vb.write_repository(tmp_path / "repo", "/models/smollm2", "float32", 4096, 32, venv, source)
    folder = repository / vb.MODEL_NAME
    assert json.loads((folder / "1" / "model.json").read_text()) == vb.engine_arguments(
        "/models/smollm2", "float32", 4096, 32)
    assert (folder / "config.pbtxt").read_text() == vb.config_pbtxt(venv)
    wrapper = (folder / "1" / "model.py").read_text()
    compile(wrapper, "model.py", "exec")
    assert vb.VLLM_BACKEND_SHA in wrapper and str(source.resolve()) in wrapper
    overlay = folder / "numpy-overlay"  # vLLM's numpy 2 -> ours, 1.x, linked ahead of it
    assert f"NUMPY_OVERLAY = {str(overlay.resolve())!r}" in wrapper
    assert (overlay / "numpy").resolve() == Path(np.__file__).resolve().parent
    assert (overlay / f"numpy-{np.__version__}.dist-info").is_dir()


def test_no_numpy_overlay_when_the_venv_has_numpy_1(tmp_path):
    site = _fake_venv(tmp_path / "venv", "1.26.4")
    assert vb.numpy_overlay(tmp_path / "repo", site) is None
    assert "NUMPY_OVERLAY = None" in vb.wrapper_source(tmp_path / "source", tmp_path / "venv", site)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_wrapper_loads_the_pinned_model_through_the_shims(tmp_path):
    """The generated model.py in a fresh interpreter whose sys.path has our site-packages (as a stub
    that ignored EXECUTION_ENV_PATH): a fake vLLM with 0.32's layout, a fake pinned source importing
    the names 0.32 moved, a fake numpy overlay."""
    site = tmp_path / "venv" / "site-packages"
    _write(site / "vllm" / "__init__.py", "__version__ = '0.32.0-fake'\n")
    _write(site / "vllm" / "inputs" / "__init__.py", "class TokensPrompt(dict):\n    pass\n")
    _write(site / "vllm" / "v1" / "__init__.py", "")
    _write(site / "vllm" / "v1" / "metrics" / "__init__.py", "")
    _write(site / "vllm" / "v1" / "metrics" / "loggers.py", "class StatLoggerBase:\n    pass\n")
    _write(site / "vllm" / "v1" / "metrics" / "buckets.py", "def build_1_2_5_buckets(m):\n    return [1, 2, 5]\n")
    source = tmp_path / "source"
    _write(source / "utils" / "metrics.py", "from vllm.v1.metrics.loggers import StatLoggerBase, build_1_2_5_buckets\n")
    _write(source / "utils" / "request.py", "from vllm.inputs.data import TokensPrompt\n")
    _write(source / "model.py", "from utils.metrics import build_1_2_5_buckets\nfrom utils.request import TokensPrompt\n"
                                "class TritonPythonModel:\n    buckets = build_1_2_5_buckets(10)\n"
                                "    prompt = TokensPrompt\n")
    overlay = tmp_path / "overlay"
    _write(overlay / "numpy" / "__init__.py", "__version__ = '1.0-overlay'\n")
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(vb.wrapper_source(source, tmp_path / "venv", site, numpy_overlay=overlay))
    check = ("import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('wrapper', {str(wrapper)!r})\n"
             "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
             "import numpy, vllm, utils\n"
             "print(module.TritonPythonModel.buckets, module.TritonPythonModel.prompt.__module__, numpy.__version__,\n"
             "      vllm.__file__, list(utils.__path__), [p for p in sys.path if p.endswith('site-packages')])\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "shims: ['vllm.inputs.data.TokensPrompt = vllm.inputs.TokensPrompt', " \
           "'vllm.v1.metrics.loggers.build_1_2_5_buckets = vllm.v1.metrics.buckets.build_1_2_5_buckets']" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last == (f"[1, 2, 5] vllm.inputs 1.0-overlay {site / 'vllm' / '__init__.py'} "
                    f"[{str((source / 'utils').resolve())!r}] [{str(site.resolve())!r}]")  # ours swapped out


def test_wrapper_reports_a_vllm_that_does_not_import(tmp_path):
    site = tmp_path / "venv" / "site-packages"
    _write(site / "vllm" / "__init__.py", "raise RuntimeError('no CPU build here')\n")
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(vb.wrapper_source(tmp_path / "source", tmp_path / "venv", site))
    done = subprocess.run([sys.executable, str(wrapper)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0
    assert "ImportError: vLLM does not import in the stub" in done.stderr
    assert "RuntimeError: no CPU build here" in done.stderr


def test_requests_carry_the_length_in_sampling_parameters():
    items = [WorkItem("hello", 3, 7), WorkItem("world", 4, 12)]
    converted = vb.backend_items(items)
    assert [c.prompt for c in converted] == ["hello", "world"] and converted[1].max_tokens == 12
    assert json.loads(converted[1].inputs["sampling_parameters"]) == {
        "max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
    # what client.bench sends for it: no max_tokens or ignore_eos tensor, only vllm_backend's inputs
    sent = build_inputs("hello", **{"max_tokens": 12, "stream": True, **converted[1].inputs})
    names = {tensor.name() for tensor in sent}
    assert names == {"text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                     "return_num_input_tokens", "return_num_output_tokens"}
    assert names <= {name for name, *_ in vb.INPUTS}
    assert all(tensor.shape() == [1, 1] for tensor in sent)  # what config.pbtxt's reshape takes
    with pytest.raises(ValueError, match="forced-length"):
        vb.backend_items([WorkItem("x", 1, 1, inputs={"messages": "[]"})])


def _response(arrays: dict[str, np.ndarray], final: bool = False):
    """A real tritonclient result, as a gRPC stream hands it to the client, holding ``arrays``."""
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._infer_result import InferResult
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    raw = service_pb2.ModelInferResponse(id="r")
    for name, array in arrays.items():
        output = raw.outputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape) or [1])
        raw.raw_output_contents.append(serialize_byte_tensor(array).item() if output.datatype == "BYTES"
                                       else array.tobytes())
    raw.parameters["triton_final_response"].bool_param = final
    return InferResult(raw)


def test_client_sums_vllm_backend_token_counts():
    result = StreamResult(start_time=0.0)
    for now, (text, count, final) in enumerate([("Hel", 1, False), ("lo w", 2, False), ("", 0, False),
                                                ("orld", 1, True)], start=1):
        read_response(result, _response({"text_output": np.array([text.encode()], dtype=object),
                                          "num_input_tokens": np.array(5, dtype=np.uint32),
                                          "num_output_tokens": np.array([count], dtype=np.uint32)}, final),
                       float(now))
    assert result.text == "Hello world"
    assert result.num_output_tokens == 4 and result.num_input_tokens == 5
    assert result.token_times == [1.0, 2.0, 4.0] and result.first_token_time == 1.0
    assert result.num_final == 1


def test_client_keeps_llm_totals_when_ids_come_with_them():
    result = StreamResult(start_time=0.0)
    read_response(result, _response({"text_output": np.array([[b"ab"]], dtype=object),
                                      "output_ids": np.array([[7, 8]], dtype=np.int32),
                                      "num_output_tokens": np.array([[9]], dtype=np.int32)}, True), 1.0)
    assert result.num_output_tokens == 9 and result.token_ids == [7, 8] and result.token_times == [1.0]


def test_failure_reason_is_the_stub_traceback():
    log = ("I1203 model_lifecycle.cc] loading\nTraceback (most recent call last):\n  File \"model.py\", line 3\n"
           "ImportError: vLLM does not import in the stub\nE1203 failed to load 'vllm_model'\n")
    assert vb.failure_reason(log).startswith("Traceback (most recent call last)")
    assert "ImportError: vLLM does not import" in vb.failure_reason(log)
    assert vb.failure_reason("E1203 failed to load 'vllm_model'\nother") == "E1203 failed to load 'vllm_model'"
