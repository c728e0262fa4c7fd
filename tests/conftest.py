"""Shared pytest fixtures. Tests never touch the network."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite must pass at any intra-op thread count (summation order changes with it):
# UNICON_TEST_THREADS=N runs it with N threads. ATEN_CPU_CAPABILITY (default, avx2, avx512) is read
# by torch itself at import and selects the vector kernels.
if os.environ.get("UNICON_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["UNICON_TEST_THREADS"]))

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture()
def fork_safe_threads():
    """Tests that fork worker processes run them with one intra-op thread: GNU OpenMP's thread pool
    does not survive fork(), and a forked child that enters a parallel region with more than one
    thread waits forever (seen with UNICON_TEST_THREADS > 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def float32_tol(n_reduce: int, scale: float = 1.0, depth: int = 1) -> float:
    """A forward-error bound for float32 results that two computations may round differently
    (another summation order: batching, thread count, vector width, masked vs absent inputs).

    A length-``n`` dot product in float32 is within ``n * eps * sum|x_i y_i|`` of the exact value
    (Higham, the γ_n bound); a value produced by ``depth`` such reductions in a row (layers) of
    magnitude ``scale`` accumulates at most ``depth * n * eps * scale`` this way, and two
    computations differ by at most twice that. Worst-case, machine-independent, and still orders of
    magnitude below what a wrong computation (a mask, an offset, a dropped token) changes.
    """
    return 2.0 * depth * n_reduce * EPS32 * max(scale, 1.0)

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


@pytest.fixture(scope="session")
def pretrained_shapes(tmp_path_factory) -> tuple[Path, Path]:
    """``(export, world)`` of a ShapesWorld model trained by the pretraining recipe.

    ``$UNICON_PRETRAINED`` (a ``save_pretrained`` folder) and ``$UNICON_WORLD`` name an existing one.
    Otherwise a world is built and the recipe is trained from scratch with test_competence.STEPS steps
    (about 4 minutes, on the recipe's two DDP ranks) through the real CLI; its ``unicon evaluate shapes`` accuracies
    are written beside the export as ``competence.json`` (asserted by test_competence)."""
    import subprocess
    import sys

    if os.environ.get("UNICON_PRETRAINED"):
        export = Path(os.environ["UNICON_PRETRAINED"])
        world = Path(os.environ.get("UNICON_WORLD", REPO / "data" / "shapes"))
        if not (export / "unicon_model.json").is_file() or not (world / "cococon_test.json").is_file():
            pytest.skip(f"$UNICON_PRETRAINED={export} / world {world} is not a pretrained model and its world")
        return export, world
    from test_competence import SHORT_SCHEDULE, STEPS

    root = tmp_path_factory.mktemp("competence")
    world, runs = root / "world", root / "runs"
    unicon = [sys.executable, "-m", "unicon.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}

    def run(*args: str) -> None:
        proc = subprocess.run([*unicon, *args], cwd=REPO, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"unicon {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    run("build-data", "shapes", "--out", str(world), "--quiet")
    run("train", "experiment=shapes_pretrain", f"data.root={world}", f"output_dir={runs}", "name=recipe",
        f"trainer.max_steps={STEPS}", *SHORT_SCHEDULE, "logger=csv", "trainer.enable_progress_bar=false")
    export = runs / "recipe" / "export"
    run("evaluate", "shapes", "--ckpt", str(export), "--world", str(world), "--out", str(root / "eval"),
        "--limit", "200", "--logger", "none")
    (runs / "recipe" / "competence.json").write_text((root / "eval" / "shapes_eval.json").read_text())
    return export, world


@pytest.fixture(scope="session")
def tiny_shapes_world(tmp_path_factory) -> Path:
    """A 12-scene ShapesWorld built by the real builder (tokenizer, mixture, CocoCon files)."""
    import sys

    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes
    root = tmp_path_factory.mktemp("shapes")
    build_shapes(["--out", str(root), "--num-train", "12", "--num-val", "4", "--num-test", "4", "--quiet",
                  "--overwrite", "--num-ureason", "2", "--geneval-per-tag", "2", "--num-drift-seeds", "2",
                  "--num-reason-train", "0"])
    return root
