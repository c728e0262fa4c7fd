"""Foundation: config composition and its errors, the CLI's routing and one-line errors,
metrics.jsonl + offline W&B logging, the report, and the table logger."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from unicon.config import ConfigError, compose, config_dir
from unicon.evaluation.logs import log_metrics, log_table
from unicon.loggers import JsonlLogger, make_loggers, read_metrics

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg_dir(tmp_path):
    """A private copy of configs/ so that tests can add experiments."""
    d = tmp_path / "configs"
    shutil.copytree(config_dir(), d)
    return d


def test_real_configs_compose():
    cfg = compose([])
    assert cfg.model.backend in ("ofa", "janus")
    assert cfg.logger.type == "wandb"
    for exp in sorted((config_dir() / "experiment").glob("*.yaml")):
        compose([f"experiment={exp.stem}"])  # every experiment file is valid against the schema


def test_layering_order(cfg_dir):
    (cfg_dir / "experiment" / "t.yaml").write_text("defaults:\n  logger: csv\nname: t\ntrainer:\n  max_epochs: 3\n")
    cfg = compose(["experiment=t", "trainer.max_epochs=5", "loss.lambda_=0.5"], cfg_dir)
    assert (cfg.name, cfg.trainer.max_epochs, cfg.logger.type, cfg.loss.lambda_) == ("t", 5, "csv", 0.5)
    assert cfg.experiment == "t"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.max_epoch=3"], "trainer.max_epoch"),
        (["trainer.max_epochs=abc"], "trainer.max_epochs"),
        (["loss=nope"], "nope.yaml"),
        (["lossy.lambda_=1"], "lossy"),
    ],
)
def test_bad_overrides_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_key_in_file_names_file(cfg_dir):
    bad = cfg_dir / "experiment" / "bad.yaml"
    bad.write_text("trainer:\n  max_epoks: 3\n")
    with pytest.raises(ConfigError) as e:
        compose(["experiment=bad"], cfg_dir)
    assert str(bad) in str(e.value) and "max_epoks" in str(e.value)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "unicon.cli", *args], capture_output=True, text=True, cwd=REPO)


def test_cli_misspelled_key_is_one_line():
    r = _cli("train", "trainer.max_epoch=3")
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "trainer.max_epoch" in err, err


def test_cli_help_and_unknown_command():
    r = _cli("--help")
    assert r.returncode == 0 and "train" in r.stdout and "evaluate" in r.stdout
    r = _cli("train", "--help")
    assert r.returncode == 0 and "experiment=" in r.stdout
    r = _cli("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_cli_hides_only_the_library_noise_it_lists(caplog):
    """``unicon.cli.quiet_libraries`` (run by every command): each :data:`LIBRARY_NOISE` message is
    hidden, warnings by message and Lightning's tip by a filter on its logger, and nothing else."""
    import logging
    import warnings

    from unicon.cli import quiet_libraries

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_libraries()
        quiet_libraries()  # twice (tests call the CLI again and again): one filter on the logger
        warnings.warn("Checkpoint directory /x/run exists and is not empty.")
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("The `srun` command is available on your system but is not used. HINT: ...")
        warnings.warn("a warning of this project")
    assert [str(w.message) for w in shown] == ["a warning of this project"]
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert len(rank_zero.filters) == 1
    with caplog.at_level(logging.INFO, logger=rank_zero.name):
        rank_zero.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero.info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]


def test_metrics_jsonl_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose(["name=logtest"])
    loggers = make_loggers(cfg, tmp_path)
    assert isinstance(loggers[-1], JsonlLogger)
    log_metrics(loggers, {"a/x": 1.5, "a/y": float("nan")}, step=3)
    log_table(loggers, "a/table", ["img", "text"], [[Image.new("RGB", (8, 8), "red"), "hi"]], step=3)
    for lg in loggers:
        lg.finalize("success")
    import wandb

    wandb.finish()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["a/x"] == 1.5 and rows[0]["a/y"] == "nan" and rows[0]["step"] == 3
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())
    table = (tmp_path / "tables" / "a_table.jsonl").read_text().splitlines()
    rec = json.loads(table[0])
    assert rec["text"] == "hi" and (tmp_path / "tables" / rec["img"]).is_file()


def test_report(tmp_path):
    lg = JsonlLogger(tmp_path)
    for step, loss in [(0, 2.0), (10, 1.0)]:
        lg.log_metrics({"train/loss": loss, "cococon/vqa/C_1": 50.0 + step}, step=step)
    from unicon.report import collect, write_report

    series = collect(tmp_path)
    assert series["train/loss"] == [(0, 2.0), (10, 1.0)]
    text = write_report(tmp_path).read_text()
    assert "| `cococon/vqa/C_1` | 60 | 50 | 2 |" in text
    assert (tmp_path / "report_curves.png").is_file()
