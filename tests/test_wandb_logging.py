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

import contextlib
import io
import json
import re
import struct
import subprocess
import sys
import time
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
           "drift/fig/mgg_heatmap", "drift/fig/strips", "ureason/fig/settings_by_category")
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


def read_finished(path: Path, timeout: float = 300.0) -> list:
    """:func:`read_records` of a finished run: W&B's service process writes the file and may still
    be flushing it when ``run.finish()`` has returned (seen on a loaded machine), so the file is
    read again until its ``exit`` record is there."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = read_records(path)
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                return records
            state = f"{len(records)} records, no exit record"
        except AssertionError as e:  # a record cut at the end of what is written so far
            state = str(e)
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: not finished after {timeout:.0f} s ({state})")
        time.sleep(0.5)


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
        self.records = read_finished(path)
        runs = [r.run for r in self.records if r.WhichOneof("record_type") == "run"]
        self.run_id = runs[0].run_id
        self.config: dict = {}
        self.metrics: dict = {}
        self.history: list[dict] = []  # one dict per row: top-level key -> value (media: their JSON dict)
        self.kinds = [r.WhichOneof("record_type") for r in self.records]
        # artifacts unicon logs (W&B logs each wandb.Table as an artifact of type run_table, too)
        self.artifacts = [r.artifact for r in self.records
                          if r.WhichOneof("record_type") == "artifact" and r.artifact.type in ("model", "evaluation")]
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
            "eval.ureason.max_samples=2", "logger.log_model=true"]


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
    from unicon.evaluation.suites import suite

    cococon_cli, drift_cli, ureason_cli = (suite(name).cli for name in ("cococon", "drift", "ureason"))
    from unicon.models import build_model
    from unicon.training.run import compose_run, train

    root = tmp_path_factory.mktemp("wandb")
    export = root / "export"
    torch.manual_seed(0)
    build_model(compose(["model=ofa_shapes_tiny"]).model, tiny_shapes_world).save_pretrained(str(export))
    progress = {"train": io.StringIO(), "evaluate": io.StringIO()}  # stderr: unicon.progress's lines
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # the evaluation CLIs take the mode from the environment
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("UNICON_PROGRESS", "plain")  # as in a SLURM log, also under `pytest -s` on a terminal
        mp.setenv("WANDB_DATA_DIR", str(root / "wandb-data"))  # W&B stages artifact files there
        with contextlib.redirect_stderr(progress["train"]):
            first = train(compose(_overrides(tiny_shapes_world, export, root / "runs")))
            run_dir = Path(first["run_dir"])
            assert first["global_step"] == 2 * STEPS_PER_EPOCH
            resumed = train(compose_run([f"resume={run_dir / 'last.ckpt'}", "trainer.max_epochs=3"], announce=False))
            assert resumed["global_step"] == 3 * STEPS_PER_EPOCH
        common = ["--ckpt", str(export), "--device", "cpu", "--logger", "wandb"]
        evaluated = {}
        with contextlib.redirect_stderr(progress["evaluate"]):
            assert cococon_cli([*common, "--data", str(tiny_shapes_world / "cococon_test.json"), "--max-samples", "4",
                                "--no-generative", "--out", str(root / "cococon")]) == 0
            assert drift_cli([*common, "--world", str(tiny_shapes_world), "--num-chains", "1", "--generations", "1",
                              "--embedders", "scene", "--out", str(root / "drift")]) == 0
            assert ureason_cli([*common, "--data", str(tiny_shapes_world), "--max-samples", "2",
                                "--out", str(root / "ureason")]) == 0
        for suite in ("cococon", "drift", "ureason"):
            (evaluated[suite],) = offline_runs(root / suite)
    first_run, resumed_run = offline_runs(run_dir)
    return {"run_dir": run_dir, "export": export, "first": first_run, "resumed": resumed_run, "evaluate": evaluated,
            "progress": {k: v.getvalue() for k, v in progress.items()}}


def _expected_rows(eval_dir: Path, epoch: int) -> dict[str, int]:
    """Rows of the sample tables of one epoch end, from the files its evaluations wrote: CocoCon's
    first ``table_rows`` samples with a contrast, drift's strips, UReason's samples."""
    from unicon.config import CocoConEvalConfig

    def jsonl(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    per_sample = jsonl(eval_dir / "cococon" / f"epoch-{epoch}" / "per_sample.jsonl")
    with_contrast = sum(len(r["nll"]["caption"]) >= 2 for r in per_sample)
    return {"cococon/samples": min(CocoConEvalConfig.table_rows, with_contrast),
            "drift/strips": len(json.loads((eval_dir / "drift" / f"epoch-{epoch}" / "drift.json").read_text())["strips"]),
            "ureason/samples": len(jsonl(eval_dir / "ureason" / f"epoch-{epoch}" / "samples.jsonl"))}


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
            # every row of the epoch's evaluation reaches its table (the files the suites wrote)
            for key, n in _expected_rows(runs["run_dir"] / "eval", epoch).items():
                assert run.media(key, step)["nrows"] == n >= 1, (key, epoch, run.media(key, step)["nrows"], n)
    # the resumed process continues: nothing of epochs 1-2 is logged again
    assert not (set(TABLES) | set(FIGURES) | set(SCALARS)) & (resumed.keys_at(STEPS_PER_EPOCH) | resumed.keys_at(2 * STEPS_PER_EPOCH))
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
        # make demo's runs (experiment=shapes_demo, and row K extending it) share one W&B group
        assert [r.run.run_group for r in run.records if r.WhichOneof("record_type") == "run"][0] == "shapes_demo"


def test_standalone_evaluations_log_tables_and_figures(runs):
    expected = {"cococon": {"cococon/samples", "cococon/fig/consistency_by_k", "cococon/fig/consistency_vs_accuracy",
                            "cococon/vqa/C_1"},
                "drift": {"drift/strips", "drift/S_t2i_table", "drift/MGG_by_generation_table", "drift/fig/strips",
                          "drift/fig/drift_curves", "drift/fig/mgg_heatmap", "drift/MCD_avg"},
                "ureason": {"ureason/samples", "ureason/fig/settings_by_category", "ureason/acc_s1"}}
    ids = set()
    for suite, run in runs["evaluate"].items():
        missing = sorted(expected[suite] - run.keys_at(0))
        assert not missing, f"unicon evaluate {suite} --logger wandb lacks {missing}"
        assert run.config["args.logger"] == "wandb" and re.fullmatch(r"[0-9a-f]{32}", run.config["weights.fingerprint"])
        ids.add(run.run_id)
    assert len(ids) == 3 and runs["first"].run_id not in ids  # each evaluation is its own W&B run


def _md5_b64(path: Path) -> str:
    import base64
    import hashlib

    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def test_artifacts_hold_the_export_and_the_evaluation_outputs(runs):
    """logger.log_model=true: each training process logs ``wb-export`` (type model) and ``wb-eval``
    (type evaluation) with the config as metadata, then finishes its W&B run."""
    import importlib.metadata

    run_dir = runs["run_dir"]
    export = run_dir / "export"
    for run, epochs in ((runs["first"], (1, 2)), (runs["resumed"], (1, 2, 3))):
        step = epochs[-1] * STEPS_PER_EPOCH
        arts = {a.name: a for a in run.artifacts}
        assert sorted(arts) == ["wb-eval", "wb-export"] and (arts["wb-export"].type, arts["wb-eval"].type) == (
            "model", "evaluation")
        for art in arts.values():
            meta = json.loads(art.metadata)
            config = meta["config"]
            assert (config["name"], config["logger"]["log_model"], meta["trainer/global_step"]) == ("wb", True, step)
            assert config["loss"]["type"] == "spearman" and config["trainer"]["limit_train_batches"] == STEPS_PER_EPOCH
            assert meta["versions.wandb"] == importlib.metadata.version("wandb")
            assert set(art.aliases) == {"latest", f"step-{step}"}
        model = {c.path: c for c in arts["wb-export"].manifest.contents}
        assert set(model) == {p.relative_to(export).as_posix() for p in export.rglob("*") if p.is_file()}
        assert {"config.json", "unicon_model.json"} <= set(model)
        evaluation = {c.path: c for c in arts["wb-eval"].manifest.contents}
        expected = {f"eval/{suite}/epoch-{e}/{name}" for e in epochs
                    for suite, name in (("cococon", "results.json"), ("drift", "drift.json"), ("ureason", "ureason.json"))}
        expected |= {"metrics.jsonl", "tables/cococon_samples.jsonl", "tables/ureason_samples.jsonl"}
        assert expected <= set(evaluation), sorted(expected - set(evaluation))
        # the run is finished after its artifacts (not left open until the process exits)
        assert "exit" in run.kinds and run.kinds.index("exit") > max(i for i, k in enumerate(run.kinds) if k == "artifact")
        assert len(run.artifacts) == 2  # one version of each per process
    # the last process's artifacts hold the bytes now on disk
    last = {c.path: c for a in runs["resumed"].artifacts for c in a.manifest.contents}
    for rel, base in (("unicon_model.json", export), ("config.json", export), ("metrics.jsonl", run_dir),
                      ("eval/drift/epoch-3/drift.json", run_dir)):
        assert last[rel].digest == _md5_b64(base / rel) and last[rel].size == (base / rel).stat().st_size, rel
    for run in runs["evaluate"].values():  # logger.log_model is a training option
        assert not run.artifacts


def test_long_loops_report_progress_in_logs(runs):
    """unicon.progress in plain mode (stderr not a terminal, as in a SLURM log): every stage of every
    suite writes its completion, at each of the three epoch ends and in each standalone evaluation
    (drift runs the text-first chains twice: the MCD seeds' and the GenEval seeds'); the batches of
    a drift generation, a loop inside the chains' loop, write nothing of their own."""
    loops = {"cococon: scoring": 1, "drift: text-first chains": 2, "drift: image-first chains": 1,
             "drift: similarities": 1, "drift: GenEval judging": 1, "ureason: generation (settings 1-3)": 1,
             "ureason: judging (exact)": 1}
    for phase, times in (("train", 3), ("evaluate", 1)):
        log = runs["progress"][phase]
        for loop, per_eval in loops.items():
            ends = re.findall(rf"^{re.escape(loop)}: (\d+)/(\d+) \w+ \(100%\) in \d+:\d\d:\d\d$", log, re.M)
            assert len(ends) == times * per_eval, (phase, loop, ends, log[-2000:])
            assert all(done == total for done, total in ends), (phase, loop, ends)
        assert not re.search(r"^drift: \S+ generation \d+:", log, re.M), log[-2000:]


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------
def test_summary_rules():
    from unicon.lightning_loggers import summary_for

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
