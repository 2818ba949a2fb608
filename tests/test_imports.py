"""The controller and the CLI must never load TensorFlow (≈2-3 s and hundreds of MiB per
process); only workers do. (The front door is a Rust binary.)"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["mpspool.router", "mpspool.supervisor.controller", "mpspool.cli", "mpspool.demo_model"],
)
def test_module_does_not_import_tensorflow(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "print(loaded[:5]); sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
