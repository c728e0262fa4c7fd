"""The shipped base model ``checkpoints/shapes_base`` (``make pretrained``, scripts/ship_base_model.py): it
loads under the current code, its provenance is complete, its world is rebuilt bit for bit from the
default options, and a live ``unicon evaluate shapes`` finds the numbers its provenance table holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DEMO_BASE_MODEL, REBUILD, REPO, SHIPPED_MODEL
from unicon.cli import main as unicon_main

PROVENANCE = SHIPPED_MODEL / "provenance.json"


def provenance() -> dict:
    return json.loads(PROVENANCE.read_text())


def test_shipped_model_loads_under_the_current_code():
    from unicon.models import load_model

    try:
        model = load_model(SHIPPED_MODEL)
    except Exception as e:  # noqa: BLE001 - any failure is the one-line message below
        pytest.fail(f"{SHIPPED_MODEL} no longer loads under the current code ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); rebuild it with `{REBUILD}`", pytrace=False)
    assert model.settings.max_source_length >= 200, "the source length must fit BagelScore's prompt"


def test_provenance_names_command_commit_world_time_and_table():
    p = provenance()
    assert p["command"].startswith("unicon train experiment=shapes_base")
    assert len(p["git_commit"]) == 40
    ancestor = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{p['git_commit']}^{{commit}}"])
    if ancestor.returncode:
        pytest.skip(f"commit {p['git_commit']} is not in this clone's history (a shallow clone)")
    assert len(p["world"]["fingerprint"]) == 64 and p["world"]["seed"] == 0
    assert p["wall_time_s"] > 0
    names = {row["name"] for row in p["table"]}
    assert {"VQA", "exact caption", "localization IoU>=0.5", "exact edits", "RealUnify GEU direct (generate) accuracy"} <= names
    for row in p["table"]:
        assert row["value"] is None or -1.0 <= row["value"] <= 1.0, row


def test_the_shipped_world_is_rebuilt_bit_for_bit(shipped_world):
    from unicon.worlds.shapes import load_world

    assert load_world(shipped_world).fingerprint() == provenance()["world"]["fingerprint"], (
        "`unicon build-data shapes` with the default options no longer builds the world the shipped model was "
        f"trained on; rebuild the model with `{REBUILD}`")


@pytest.mark.slow
def test_live_evaluation_finds_the_provenance_numbers(pretrained_shapes, tmp_path):
    """The provenance's `unicon evaluate shapes` (VQA, caption, grounding; 500 examples each), run again.
    Beam search and greedy boxes are deterministic up to float32 summation order, which differs between
    CPUs and thread counts: a near-tie can flip, so each accuracy may move by a few examples of 500."""
    export, world = pretrained_shapes
    recorded = provenance()["evaluations"]["shapes"]["metrics"]
    out = tmp_path / "eval"
    assert unicon_main(["evaluate", "shapes", "--ckpt", str(export), "--world", str(world), "--out", str(out),
                        "--limit", "500", "--tasks", "vqa", "caption", "grounding", "--logger", "none",
                        "--device", "cpu"]) == 0
    live = json.loads((out / "shapes_eval.json").read_text())
    live = live.get("metrics", live)
    for key in ("vqa_accuracy", "caption_match", "loc_iou50"):
        assert live[f"{key}_n"] == recorded[f"{key}_n"]
        assert live[key] == pytest.approx(recorded[key], abs=3 / recorded[f"{key}_n"]), key


def test_make_demo_refuses_without_its_shipped_model_with_the_rebuild_command(tmp_path):
    """Without checkpoints/shapes_capgap_base (the demo's start), `make demo` stops at once and names the
    command that makes it."""
    proj = tmp_path / "p"
    for world in ("shapes", "shapes_capgap"):
        (proj / "data" / world).mkdir(parents=True)
        (proj / "data" / world / "world.json").write_text("{}")
    (proj / "Makefile").symlink_to(REPO / "Makefile")
    venv = REPO / ".venv"
    proc = subprocess.run(["make", "-o", str(venv / ".unicon-installed"), "demo", f"VENV={venv}"], cwd=proj,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "make pretrained BASE=shapes_capgap_base" in proc.stdout + proc.stderr


# -- checkpoints/shapes_capgap_base: the base model of the caption-gap world, the start of `make demo` --------

CAPGAP_PROVENANCE = DEMO_BASE_MODEL / "provenance.json"


@pytest.fixture(scope="module")
def capgap_world(tmp_path_factory):
    """The caption-gap world, built with the options its provenance records."""
    command = json.loads(CAPGAP_PROVENANCE.read_text())["world"]["build_command"].split()
    options = command[command.index("--out") + 2:]
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes

    root = tmp_path_factory.mktemp("capgap_world")
    assert build_shapes(["--out", str(root), *options, "--quiet", "--overwrite"]) == 0
    return root


def test_demo_base_model_loads_and_its_provenance_names_command_commit_world_and_figures():
    from unicon.models import load_model

    load_model(DEMO_BASE_MODEL)
    p = json.loads(CAPGAP_PROVENANCE.read_text())
    assert p["command"].startswith("unicon train experiment=shapes_capgap_base data.root=data/shapes_capgap")
    assert "--caption-gap purple --caption-gap-keep 0" in p["world"]["build_command"]
    assert len(p["git_commit"]) == 40 and len(p["world"]["fingerprint"]) == 64 and p["wall_time_s"] > 0
    test = p["evaluations"]["cococon_test"]
    assert test["command"].startswith("unicon evaluate cococon --ckpt checkpoints/shapes_capgap_base")
    table = {row["name"]: row["value"] for row in p["table"]}
    assert all(0.0 <= v <= 1.0 for v in table.values()), table  # every figure was read from its results file
    # the blind spot the demo is about: the base model captions purple far worse than VQA answers about it
    assert table["test: purple caption acc@1"] < table["test: purple VQA acc@1"] - 0.5


@pytest.mark.slow
def test_the_demo_world_is_rebuilt_bit_for_bit(capgap_world):
    from unicon.worlds.shapes import load_world

    assert load_world(capgap_world).fingerprint() == json.loads(CAPGAP_PROVENANCE.read_text())["world"]["fingerprint"], (
        "the recorded `unicon build-data shapes --caption-gap ...` no longer builds the world "
        f"{DEMO_BASE_MODEL} was trained on; retrain it (checkpoints/README.md)")


def test_ship_script_knows_each_shipped_model_its_experiment_and_world(tmp_path):
    """Every model `make pretrained BASE=...` ships has its experiment config, trains on its own world, and the
    world options the script builds it with are the ones its tracked provenance records."""
    sys.path.insert(0, str(REPO / "scripts"))
    import ship_base_model
    from unicon.config import compose

    assert set(ship_base_model.MODELS) == {"shapes_base", "shapes_capgap_base"}
    for name, spec in ship_base_model.MODELS.items():
        cfg = compose([f"experiment={name}"])
        assert cfg.data.root == str(spec.world), name
        command = ship_base_model.build_command(tmp_path / name, spec.world_options)
        recorded = json.loads((REPO / "checkpoints" / name / "provenance.json").read_text())["world"]
        if "build_command" in recorded:
            options = recorded["build_command"].split()
            assert command[command.index("--out") + 2:] == options[options.index("--out") + 2:], name
        else:
            assert not spec.world_options, name


@pytest.mark.parametrize("base", [None, "shapes_capgap_base"])
def test_make_pretrained_recipe_passes_the_ship_script_arguments_it_takes(base):
    """`make pretrained` and `make pretrained BASE=shapes_capgap_base`, as the README writes them: each step of
    the recipe (`make -n`, nothing run) is a ship_base_model.py call whose arguments its parser takes, for that
    model."""
    import shlex

    sys.path.insert(0, str(REPO / "scripts"))
    import ship_base_model

    venv = REPO / ".venv"
    argv = ["make", "-n", "-o", str(venv / ".unicon-installed"), "pretrained", *([f"BASE={base}"] if base else [])]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    calls = [shlex.split(line) for line in proc.stdout.splitlines() if "ship_base_model.py" in line]
    assert [c[c.index("scripts/ship_base_model.py") + 1] for c in calls] == ["train", "evaluate"], proc.stdout
    for call in calls:
        args = ship_base_model.parse_args(call[call.index("scripts/ship_base_model.py") + 1:])
        assert args.experiment == (base or "shapes_base")


def test_ship_script_help():
    """`scripts/ship_base_model.py --help` runs (the rebuild command's entry point)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "ship_base_model.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "train" in proc.stdout and "evaluate" in proc.stdout
