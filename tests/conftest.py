from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEMO_ROWS = 1000


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small demo model in TF Serving layout (base path with version 1)."""
    from mpspool.demo_model import build_demo_model

    base = tmp_path_factory.mktemp("models") / "demo"
    build_demo_model(base, embedding_rows=DEMO_ROWS, version=1)
    return base


@pytest.fixture(scope="session")
def reference_model(demo_model_dir: Path):
    """The same SavedModel called in-process: what the pool's answers must equal."""
    import tensorflow as tf

    return tf.saved_model.load(str(demo_model_dir / "1")).signatures["serving_default"]


# The real nvidia-cuda-mps-control that dev/setup unpacks; pools started by tests find it
# through this variable (mps/control.py), like an administrator's explicit path.
_MPS_CONTROL = (
    Path(__file__).resolve().parent.parent
    / ".tools/nvidia-cuda-mps/usr/bin/nvidia-cuda-mps-control"
)
if _MPS_CONTROL.exists():
    os.environ.setdefault("MPSPOOL_MPS_CONTROL", str(_MPS_CONTROL))
