"""Shared pytest fixtures. Tests never touch the network."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("UNICON_SHARED_DIR", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout (real benchmark files, papers, the OFA fixture)."""
    if not SHARED.is_dir():
        pytest.skip(f"needs the shared data directory {SHARED} (not present on this machine)")
    return SHARED


@pytest.fixture(scope="session")
def shared_data(shared_dir) -> Path:
    d = shared_dir / "data"
    if not d.is_dir():
        pytest.skip(f"needs {d} (real benchmark files)")
    return d


@pytest.fixture(scope="session")
def ofa_fixture_dir(shared_dir) -> Path:
    d = shared_dir / "fixtures" / "ofa-reference-tiny"
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"needs the OFA reference fixture in {d}")
    return d
