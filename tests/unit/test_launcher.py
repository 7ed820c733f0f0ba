"""The launcher's layout and environment, checked without starting a server."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from backend.server.launcher import (
    find_tritonserver,
    prepare_backend_directory,
    python_stub_tag,
    server_environment,
)


def test_backend_directory_holds_the_stub_for_this_python(tmp_path):
    installation = find_tritonserver()
    backend_dir = prepare_backend_directory(installation, tmp_path)
    if installation.wheel_root is None:  # NGC image: tritonserver's own backends are used
        assert backend_dir is None
        return
    stub = backend_dir / "python" / "triton_python_backend_stub"
    assert stub.exists() and os.access(stub, os.X_OK)
    source = installation.wheel_root / "python_backend_stubs" / python_stub_tag() / "triton_python_backend_stub"
    assert stub.read_bytes() == source.read_bytes()
    assert (backend_dir / "python" / "libtriton_python.so").exists()


def test_environment_puts_this_venv_first_and_libpython_on_the_library_path():
    installation = find_tritonserver()
    env = server_environment(installation, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    library_dirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert library_dirs[0] == sysconfig.get_config_var("LIBDIR")
    assert library_dirs[-1] == "/opt/x"
    if installation.wheel_root is not None:
        assert any(d.endswith("nvidia_pytriton.libs") for d in library_dirs)
