"""What reaches Weights & Biases, read back from the offline run files.

A tiny OFA (random weights, saved like a pretrained export) is trained for two short epochs with
``experiment=shapes_demo``'s epoch-end CocoCon, drift and UReason evaluation, W&B offline; then
resumed for a third epoch; then ``unicon evaluate cococon|drift|ureason --logger wandb`` run on
the export. Each ``offline-run-*/run-<id>.wandb`` file is decoded record by record
(:func:`read_records`) and checked: every table, figure and headline scalar at every epoch end,
the flattened run config with git/versions/fingerprint, the summary definitions, and the W&B run
id kept across the resume.

The ``.wandb`` file is LevelDB-log framing (W&B's ``datastore`` format, which wandb 0.31 no longer
ships a Python reader for): a 7-byte file header (``:W&B``, magic 0xBEE1, version), then 32 KiB
blocks of records, each with a 7-byte header (crc32c, length u16 little-endian, type u8: FULL=1,
FIRST=2, MIDDLE=3, LAST=4); a block tail shorter than a header is zero padding. Payloads are
serialized ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unicon.config import compose
from unicon.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# keys every epoch end must log
TABLES = ("cococon/samples", "drift/strips", "drift/S_t2i_table", "drift/S_i2t_table",
          "drift/MGG_by_generation_table", "ureason/samples")
FIGURES = ("cococon/fig/consistency_by_k", "cococon/fig/consistency_vs_accuracy", "drift/fig/drift_curves",
           "drift/fig/mgg_heatmap", "drift/fig/strips")
SCALARS = ("cococon/vqa/C_1", "cococon/failed", "drift/MCD_avg", "drift/MGG", "drift/failed", "ureason/acc_s1",
           "ureason/failed")
STEPS_PER_EPOCH = 2  # trainer.limit_train_batches


# ---------------------------------------------------------------------------------------------
# Reading an offline run
# ---------------------------------------------------------------------------------------------
BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """Every ``Record`` of a ``.wandb`` file, in order (the framing is in the module docstring)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path}: not a W&B transaction log"
    out, pos, parts = [], HEADER, None
    while len(data) - pos >= HEADER:
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # zero padding at the end of a block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # the rest of the block is padding
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        assert len(payload) == length, f"{path}: record cut at byte {pos}"
        pos += HEADER + length
        if kind == FIRST:
            parts = [payload]
            continue
        if kind in (MIDDLE, LAST):
            assert parts is not None, f"{path}: {kind=} without a FIRST record"
            parts.append(payload)
            if kind == MIDDLE:
                continue
            payload, parts = b"".join(parts), None
        else:
            assert kind == FULL, f"{path}: unknown record type {kind}"
        record = pb.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def _item_value(item):
    """A history item's value: ``value_json`` (what wandb 0.31 writes) or the typed ``value`` oneof."""
    field = item.WhichOneof("value")
    if field is None:
        return json.loads(item.value_json) if item.value_json else None
    if field == "json":
        return json.loads(item.json)
    return None if field == "none" else getattr(item, field)


class OfflineRun:
    """The run id, config, metric definitions and history rows of one ``offline-run-*`` folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        (path,) = folder.glob("run-*.wandb")
        self.records = read_records(path)
        runs = [r.run for r in self.records if r.WhichOneof("record_type") == "run"]
        self.run_id = runs[0].run_id
        self.config: dict = {}
        self.metrics: dict = {}
        self.history: list[dict] = []  # one dict per row: top-level key -> value (media: their JSON dict)
        for r in self.records:
            kind = r.WhichOneof("record_type")
            if kind == "config":
                self.config.update({u.key: json.loads(u.value_json) for u in r.config.update if u.key})
            elif kind == "metric" and r.metric.name:
                self.metrics[r.metric.name] = r.metric
            elif kind == "history":
                row: dict = {}
                for item in r.history.item:
                    # a media value is flattened: ["cococon/samples", "_type"] -> row["cococon/samples"]["_type"]
                    *parents, leaf = [item.key] if item.key else list(item.nested_key)
                    node = row
                    for k in parents:
                        node = node.setdefault(k, {})
                    node[leaf] = _item_value(item)
                self.history.append(row)

    def rows_at(self, global_step: int) -> list[dict]:
        return [row for row in self.history if row.get("trainer/global_step") == global_step]

    def keys_at(self, global_step: int) -> set[str]:
        return {k for row in self.rows_at(global_step) for k in row}

    def media(self, key: str, global_step: int) -> dict:
        (value,) = [row[key] for row in self.rows_at(global_step) if key in row]
        return value


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    return [OfflineRun(f) for f in sorted((run_dir / "wandb").glob("offline-run-*"))]


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------
def _overrides(world: Path, export: Path, out: Path) -> list[str]:
    """``make demo``'s run, shrunk the way tests/test_readme_commands.py shrinks it."""
    return ["experiment=shapes_demo", f"data.root={world}", f"init_from={export}", f"output_dir={out}",
            "name=wb", "logger=wandb", "logger.mode=offline", "trainer.enable_progress_bar=false",
            f"trainer.limit_train_batches={STEPS_PER_EPOCH}", "trainer.log_every_n_steps=1",
            "eval.fail_on_error=true", "eval.cococon.max_samples=4", "eval.cococon.generative=false",
            "eval.drift.num_chains=1", "eval.drift.generations=1", "eval.drift.embedders=[scene]",
            "eval.ureason.max_samples=2"]


_BUILT: dict[str, dict] = {}


@pytest.fixture(scope="session")
def runs(tiny_shapes_world, tmp_path_factory):
    """``{"run_dir", "export", "first", "resumed", "evaluate": {suite: OfflineRun}}``.

    Built once per session: tests/test_report_html.py imports this fixture (pytest makes one
    fixture per module that holds it; both return the run made first)."""
    key = str(tiny_shapes_world)
    if key not in _BUILT:
        _BUILT[key] = _make_runs(tiny_shapes_world, tmp_path_factory)
    return _BUILT[key]


def _make_runs(tiny_shapes_world: Path, tmp_path_factory) -> dict:
    from unicon.evaluation.cococon.cli import cli as cococon_cli
    from unicon.evaluation.drift.cli import cli as drift_cli
    from unicon.evaluation.ureason.cli import cli as ureason_cli
    from unicon.models import build_model
    from unicon.training.run import compose_run, train

    root = tmp_path_factory.mktemp("wandb")
    export = root / "export"
    torch.manual_seed(0)
    build_model(compose(["model=ofa_shapes_tiny"]).model, tiny_shapes_world).save_pretrained(str(export))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # the evaluation CLIs take the mode from the environment
        mp.setenv("WANDB_SILENT", "true")
        first = train(compose(_overrides(tiny_shapes_world, export, root / "runs")))
        run_dir = Path(first["run_dir"])
        assert first["global_step"] == 2 * STEPS_PER_EPOCH
        resumed = train(compose_run([f"resume={run_dir / 'last.ckpt'}", "trainer.max_epochs=3"], announce=False))
        assert resumed["global_step"] == 3 * STEPS_PER_EPOCH
        common = ["--ckpt", str(export), "--device", "cpu", "--logger", "wandb"]
        evaluated = {}
        assert cococon_cli([*common, "--data", str(tiny_shapes_world / "cococon_test.json"), "--max-samples", "4",
                            "--no-generative", "--out", str(root / "cococon")]) == 0
        assert drift_cli([*common, "--world", str(tiny_shapes_world), "--num-chains", "1", "--generations", "1",
                          "--embedders", "scene", "--out", str(root / "drift")]) == 0
        assert ureason_cli([*common, "--data", str(tiny_shapes_world), "--max-samples", "2",
                            "--out", str(root / "ureason")]) == 0
        for suite in ("cococon", "drift", "ureason"):
            (evaluated[suite],) = offline_runs(root / suite)
    first_run, resumed_run = offline_runs(run_dir)
    return {"run_dir": run_dir, "export": export, "first": first_run, "resumed": resumed_run, "evaluate": evaluated}


def test_every_epoch_end_logs_every_table_figure_and_scalar(runs):
    first, resumed = runs["first"], runs["resumed"]
    for run, epochs in ((first, (1, 2)), (resumed, (3,))):
        for epoch in epochs:
            step = epoch * STEPS_PER_EPOCH
            keys = run.keys_at(step)
            missing = sorted(set(TABLES + FIGURES + SCALARS) - keys)
            assert not missing, f"epoch {epoch} (global step {step}) lacks {missing}"
            for key in TABLES:
                table = run.media(key, step)
                assert table["_type"] == "table-file" and table["nrows"] >= 1, (key, table)
                assert (run.folder / "files" / table["path"]).is_file()
            for key in FIGURES:
                image = run.media(key, step)
                assert image["_type"] == "image-file" and image["format"] == "png", (key, image)
                assert (run.folder / "files" / image["path"]).is_file()
    # the symptom of the old explicit-step logging: W&B dropping rows logged "in the past"
    for run in (first, resumed):
        log = (run.folder / "logs" / "debug-internal.log").read_text()
        assert "ignoring partial history record" not in log


def test_run_config_is_the_flattened_config_with_git_versions_and_fingerprint(runs):
    import importlib.metadata

    from unicon.core import weights_fingerprint
    from unicon.loggers import git_state
    from unicon.models import load_model

    config = runs["first"].config
    expected = {"model.backend": "ofa", "model.preset": "shapes-tiny", "loss.type": "spearman",
                "loss.lambda_": compose(["experiment=shapes_demo"]).loss.lambda_, "optim.lr": 1e-4,
                "trainer.limit_train_batches": STEPS_PER_EPOCH, "eval.cococon.max_samples": 4,
                "eval.drift.embedders": ["scene"], "experiment": "shapes_demo", "name": "wb"}
    assert {k: config.get(k) for k in expected} == expected
    for dist in ("torch", "lightning", "transformers", "wandb", "unicon"):
        assert config[f"versions.{dist}"] == importlib.metadata.version(dist)
    assert config["weights.fingerprint"] == weights_fingerprint(load_model(runs["export"]))
    git = git_state()
    if (REPO / ".git").exists():
        # the commit the run started from (others may commit to a shared checkout meanwhile, and
        # edit files: git.dirty is only checked for its type)
        assert re.fullmatch(r"[0-9a-f]{40}", config["git.commit"]) and isinstance(config["git.dirty"], bool)
        ancestor = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", config["git.commit"], "HEAD"])
        assert ancestor.returncode == 0, f"{config['git.commit']} is not HEAD or one of its ancestors"
    else:
        assert not {"git.commit", "git.dirty"} & set(config) and git == {}
    # the resumed process records the checkpoint it restarted from, and says it resumed
    resumed = runs["resumed"].config
    assert resumed["resume"] == str(runs["run_dir"] / "last.ckpt")
    assert re.fullmatch(r"[0-9a-f]{32}", resumed["weights.resume_fingerprint"])
    assert resumed["weights.resume_fingerprint"] != config["weights.fingerprint"]  # trained for two epochs


def test_summaries_are_defined_for_headline_metrics(runs):
    metrics = runs["first"].metrics
    for key, best in (("cococon/vqa/C_1", "max"), ("drift/MCD_avg", "max"), ("drift/MGG", "max"),
                      ("ureason/acc_s1", "max"), ("train/loss", "min")):
        m = metrics[key]
        assert getattr(m.summary, best) and m.summary.last and m.step_metric == "trainer/global_step", (key, m)
    # counts, tables and charts (drift/MGG_by_generation matches the MGG rule by name): no summary
    assert not {"cococon/vqa/n_1", "drift/strips", "drift/MGG_by_generation", "cococon/samples"} & set(metrics)


def test_resume_continues_the_same_wandb_run(runs):
    first, resumed = runs["first"], runs["resumed"]
    stored = (runs["run_dir"] / "wandb_run_id").read_text().strip()
    assert first.run_id == resumed.run_id == stored
    assert first.folder.name.endswith(stored) and resumed.folder.name.endswith(stored)
    for run in (first, resumed):  # resume="allow" is recorded: `wandb sync` appends the second part to the first
        assert [r.run.resume for r in run.records if r.WhichOneof("record_type") == "run"][0]


def test_standalone_evaluations_log_tables_and_figures(runs):
    expected = {"cococon": {"cococon/samples", "cococon/fig/consistency_by_k", "cococon/fig/consistency_vs_accuracy",
                            "cococon/vqa/C_1"},
                "drift": {"drift/strips", "drift/S_t2i_table", "drift/MGG_by_generation_table", "drift/fig/strips",
                          "drift/fig/drift_curves", "drift/fig/mgg_heatmap", "drift/MCD_avg"},
                "ureason": {"ureason/samples", "ureason/acc_s1"}}
    ids = set()
    for suite, run in runs["evaluate"].items():
        missing = sorted(expected[suite] - run.keys_at(0))
        assert not missing, f"unicon evaluate {suite} --logger wandb lacks {missing}"
        assert run.config["args.logger"] == "wandb" and re.fullmatch(r"[0-9a-f]{32}", run.config["weights.fingerprint"])
        ids.add(run.run_id)
    assert len(ids) == 3 and runs["first"].run_id not in ids  # each evaluation is its own W&B run


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------
def test_summary_rules():
    from unicon.loggers import summary_for

    assert summary_for("cococon/t2i/C_3") == summary_for("cococon/probe/vqa/rho") == "max,last"
    assert summary_for("drift/clip/MCD_i2t") == summary_for("drift/MGG_counting") == "max,last"
    assert summary_for("drift/drift_rate_t2t") == summary_for("train/loss_const") == "min,last"
    assert summary_for("cococon/vqa/n_1") is summary_for("ureason/delta_12") is summary_for("train/lr") is None


def test_flatten_config_keeps_lists_and_empty_sections():
    from unicon.loggers import flatten_config

    flat = flatten_config(compose(["loss.lambda_=0.5"]))
    assert flat["loss.lambda_"] == 0.5 and isinstance(flat["loss.tasks"], list) and "loss" not in flat
    assert flatten_config({"a": {"b": {"c": 1}, "d": {}}, "e": [1, 2]}) == {"a.b.c": 1, "a.d": {}, "e": [1, 2]}


def test_persistent_run_id_is_made_once_and_checked(tmp_path):
    from unicon.loggers import WANDB_ID_FILE, persistent_run_id

    first = persistent_run_id(tmp_path)
    assert re.fullmatch(r"[a-z0-9]{8}", first) and persistent_run_id(tmp_path) == first
    (tmp_path / WANDB_ID_FILE).write_text("not/an id\n")
    with pytest.raises(UserError, match=WANDB_ID_FILE):
        persistent_run_id(tmp_path)


def test_git_state_outside_a_checkout_is_empty(tmp_path, monkeypatch):
    import unicon
    from unicon.loggers import environment_info, git_state

    (tmp_path / "__init__.py").write_text("")
    monkeypatch.setattr(unicon, "__file__", str(tmp_path / "__init__.py"))
    assert git_state() == {}
    info = environment_info()
    assert "git.commit" not in info and info["versions.python"] == ".".join(map(str, sys.version_info[:3]))
