"""Config composition: experiments that extend experiments, choice fields that fail at compose
time, checkpoints whose stored config holds removed keys, and the learning rate that Lightning's
``LearningRateMonitor`` logs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import get_type_hints

import pytest
import torch
from omegaconf import OmegaConf

from unicon.config import (REMOVED_KEYS, STRATEGIES, ConfigError, RunConfig, compose, compose_resume, config_dir,
                           from_container)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg_dir(tmp_path):
    """A private copy of configs/ so that tests can add experiments."""
    d = tmp_path / "configs"
    shutil.copytree(config_dir(), d)
    return d


def write_experiment(cfg_dir: Path, name: str, text: str) -> Path:
    path = cfg_dir / "experiment" / f"{name}.yaml"
    path.write_text(text)
    return path


def schema_fields(schema: type = RunConfig, prefix: str = ""):
    """``(dotted key, dataclass field)`` of every leaf of the schema."""
    hints = get_type_hints(schema)
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            yield from schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def allowed(key: str) -> tuple[str, ...]:
    choices = dict(schema_fields())[key].metadata["choices"]
    return tuple(choices()) if callable(choices) else choices


def plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


# ---------------------------------------------------------------------------------------------
# 1. experiments extend experiments
# ---------------------------------------------------------------------------------------------
def test_the_control_is_the_consistency_experiment_with_loss_none_and_its_name():
    control = plain(compose(["experiment=shapes_consistency_control"]))
    spelled_out = plain(compose(["experiment=shapes_consistency", "loss=none", "name=shapes_consistency_control"]))
    assert control.pop("experiment") == "shapes_consistency_control"
    assert spelled_out.pop("experiment") == "shapes_consistency"
    assert control == spelled_out
    assert (control["loss"]["type"], control["loss"]["lambda_"], control["loss"]["gamma"]) == ("none", 0.0, 0.5)


def test_the_table2_methods_differ_only_in_their_loss_and_name():
    from unicon.experiments.table2 import METHODS

    configs = {method: plain(compose(overrides)) for method, overrides in METHODS.items()}
    for cfg in configs.values():
        for key in ("name", "experiment", "loss"):
            cfg.pop(key)
    reference = configs.pop("K")
    assert all(cfg == reference for cfg in configs.values())


def test_chained_extension_merges_parents_first(cfg_dir):
    write_experiment(cfg_dir, "grand", "defaults:\n  loss: hinge\n  logger: csv\nname: grand\nseed: 3\n"
                                       "trainer:\n  max_epochs: 4\n  max_steps: 40\ndata:\n  tasks: [vqa, t2i]\n")
    write_experiment(cfg_dir, "parent", "extends: grand\ndefaults:\n  loss: none\nname: parent\n"
                                        "trainer:\n  max_epochs: 5\ndata:\n  tasks: [caption]\n")
    write_experiment(cfg_dir, "child", "extends: parent\nname: child\nloss:\n  gamma: 0.0\n")
    cfg = compose(["experiment=child"], cfg_dir)
    assert (cfg.experiment, cfg.name, cfg.seed) == ("child", "child", 3)
    assert (cfg.loss.type, cfg.loss.gamma, cfg.logger.type) == ("none", 0.0, "csv")  # parent's defaults win
    assert (cfg.trainer.max_epochs, cfg.trainer.max_steps) == (5, 40)  # mappings merge key by key
    assert list(cfg.data.tasks) == ["caption"]  # a list is replaced, not merged
    # the command line still wins over every experiment in the chain
    cfg = compose(["experiment=child", "loss=spearman", "trainer.max_steps=7"], cfg_dir)
    assert (cfg.loss.type, cfg.trainer.max_steps, cfg.trainer.max_epochs) == ("spearman", 7, 5)


def test_a_bad_value_is_attributed_to_the_file_in_the_chain_that_set_it(cfg_dir):
    parent = write_experiment(cfg_dir, "parent", "optim:\n  scheduler: cosine_restarts\n")
    write_experiment(cfg_dir, "child", "extends: parent\nname: child\n")
    with pytest.raises(ConfigError) as e:
        compose(["experiment=child"], cfg_dir)
    assert str(e.value).startswith(f"{parent}: optim.scheduler='cosine_restarts' is not one of")


@pytest.mark.parametrize("files, culprit, needle", [
    ({"a": "extends: nowhere\n"}, "a", "no config file"),
    ({"a": "extends: b\n", "b": "extends: nowhere\n"}, "b", "nowhere.yaml"),
    ({"a": "extends: a\n"}, "a", "cycle a -> a"),
    ({"a": "extends: b\n", "b": "extends: c\n", "c": "extends: a\n"}, "c", "cycle a -> b -> c -> a"),
    ({"a": "extends: [b]\n"}, "a", "expected the name of one experiment"),
    ({"a": "defaults:\n  - loss: none\n"}, "a", "defaults: expected a mapping"),
    ({"a": "defaults:\n  losses: none\n"}, "a", "unknown config group(s) in defaults: ['losses']"),
    ({"a": "extends: b\n", "b": "trainer:\n  max_epoks: 3\n"}, "b", "max_epoks"),
])
def test_a_broken_chain_names_the_file(cfg_dir, files, culprit, needle):
    for name, text in files.items():
        write_experiment(cfg_dir, name, text)
    with pytest.raises(ConfigError) as e:
        compose(["experiment=a"], cfg_dir)
    message = str(e.value)
    assert message.startswith(str(cfg_dir / "experiment" / f"{culprit}.yaml")), message
    assert needle in message and "\n" not in message, message


def test_the_cli_prints_an_extended_experiment(tmp_path):
    r = subprocess.run([sys.executable, "-m", "unicon.cli", "train", "experiment=shapes_consistency_control",
                        "--print-config"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    printed = OmegaConf.create(r.stdout)
    assert (printed.name, printed.loss.type, printed.trainer.limit_train_batches) == (
        "shapes_consistency_control", "none", 150)


# ---------------------------------------------------------------------------------------------
# 2. choice fields fail at compose time, naming the key and where the value came from
# ---------------------------------------------------------------------------------------------
CHOICE_KEYS = [key for key, f in schema_fields() if "choices" in f.metadata]


def test_choice_fields_are_found():
    assert {"model.backend", "loss.type", "optim.scheduler", "trainer.strategy", "eval.drift.embedders"} <= set(
        CHOICE_KEYS)


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_every_choice_field_refuses_a_value_outside_its_set(key):
    each = dict(schema_fields())[key].metadata["each"]
    with pytest.raises(ConfigError) as e:
        compose([f"{key}=[bogus]" if each else f"{key}=bogus"])
    assert str(e.value) == f"command line: {key}='bogus' is not one of: {', '.join(allowed(key))}"


@pytest.mark.parametrize("key", [k for k in CHOICE_KEYS if dict(schema_fields())[k].metadata["each"]])
def test_every_list_choice_field_refuses_an_empty_list_and_duplicates(key):
    with pytest.raises(ConfigError, match=re.escape(f"command line: {key}=[] must name at least one of")):
        compose([f"{key}=[]"])
    first = allowed(key)[0]
    with pytest.raises(ConfigError, match=re.escape(f"{key}=['{first}', '{first}'] lists a value twice")):
        compose([f"{key}=[{first},{first}]"])


def test_a_choice_set_in_a_group_file_names_the_file(cfg_dir):
    loss_file = cfg_dir / "loss" / "spearman.yaml"
    loss_file.write_text(loss_file.read_text().replace("regularization: l2", "regularization: l1"))
    with pytest.raises(ConfigError) as e:
        compose([], cfg_dir)
    assert str(e.value) == f"{loss_file}: loss.regularization='l1' is not one of: l2, kl"


@pytest.mark.parametrize("override, message", [
    ("loss.task_lambda.caption=1", "loss.task_lambda.caption=1.0 names no evaluation task: use one of vqa, localization, t2i"),
    ("loss.task_lambda.t2i=-0.5", "loss.task_lambda.t2i=-0.5 must be a number >= 0"),
    ("loss.task_lambda.t2i=nan", "loss.task_lambda.t2i=nan must be a number >= 0"),
    ("loss.task_lambda.t2i=lots", "invalid key 'loss.task_lambda.t2i': Value 'lots' of type 'str' could not be converted to Float"),
])
def test_task_lambda_is_checked_at_compose_time_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(f"command line: {message}")):
        compose(["experiment=shapes_consistency", override])
    assert dict(compose(["loss.task_lambda.t2i=0.25"]).loss.task_lambda) == {"t2i": 0.25}


def test_the_schema_choices_are_the_values_the_code_implements():
    from unicon.data.mixture import TRAINABLE_TASKS
    from unicon.losses.consistency import DIRECTIONS, LOSS_TYPES, SOFT_RANKS
    from unicon.training.module import SCHEDULERS

    assert set(allowed("loss.type")) == set(LOSS_TYPES)
    assert set(allowed("loss.soft_rank")) == set(SOFT_RANKS)
    assert set(allowed("loss.direction")) == set(DIRECTIONS)
    assert set(allowed("data.tasks")) == set(TRAINABLE_TASKS)
    assert set(allowed("optim.scheduler")) == set(SCHEDULERS)
    assert set(allowed("trainer.strategy")) == set(STRATEGIES)
    deepspeed = {s for s in STRATEGIES if s.startswith("deepspeed")}
    assert deepspeed == {p.stem for p in (config_dir() / "strategy").glob("*.json")}


def test_model_backend_choices_are_the_registry_and_the_installed_plugins(monkeypatch):
    import importlib.metadata

    from unicon.config import IN_TREE_BACKENDS
    from unicon.models.registry import registered_backends

    assert set(IN_TREE_BACKENDS) <= set(registered_backends())  # importing unicon.models registers them
    plugin = importlib.metadata.EntryPoint("acme", "acme_models.backend", "unicon.backends")
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        return [plugin] if kw.get("group") == "unicon.backends" else real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert allowed("model.backend") == (*IN_TREE_BACKENDS, "acme")
    assert plain(compose(["model.backend=acme"]))["model"]["backend"] == "acme"


# ---------------------------------------------------------------------------------------------
# 3. no dead keys; stored configs with removed keys still load
# ---------------------------------------------------------------------------------------------
def test_every_schema_field_is_read():
    """A field that no module reads (nor a config file interpolates, ``${data.coco_root}``) is a dead
    key: delete it, and list it in REMOVED_KEYS so that old checkpoints still load."""
    src = "\n".join(p.read_text() for p in (REPO / "src" / "unicon").rglob("*.py") if p.name != "config.py")
    configs = "\n".join(p.read_text() for p in config_dir().rglob("*.yaml"))
    unread = [key for key, f in schema_fields()
              if not re.search(rf"\.{f.name}\b|[\"']{f.name}[\"']", src) and "${" + key + "}" not in configs]
    assert unread == []


def test_removed_keys_are_not_in_the_schema():
    keys = {key for key, _ in schema_fields()}
    assert {"data.world", "data.build", "loss.label_smoothing"} <= set(REMOVED_KEYS)
    assert not keys & set(REMOVED_KEYS)


def old_stored_config(**overrides) -> dict:
    """A checkpoint's stored config as an older version wrote it: with every removed key."""
    stored = plain(compose(["name=old", *[f"{k}={v}" for k, v in overrides.items()]]))
    for key in REMOVED_KEYS:
        section, _, leaf = key.partition(".")
        stored[section][leaf] = "coco" if leaf == "world" else 0
    return stored


def test_a_stored_config_with_removed_keys_loads_and_resumes():
    stored = old_stored_config()
    assert plain(from_container(stored)) == plain(compose(["name=old"]))
    cfg, changes = compose_resume(stored, "old.ckpt (stored config)", ["trainer.max_epochs=4"])
    assert cfg.trainer.max_epochs == 4 and changes == ["trainer.max_epochs: 1 -> 4"]


def test_a_stored_config_with_an_unknown_key_is_still_refused_naming_it():
    stored = old_stored_config()
    stored["loss"]["temperature"] = 2.0
    with pytest.raises(ConfigError, match=r"^old.ckpt \(stored config\): invalid key 'loss.temperature'"):
        compose_resume(stored, "old.ckpt (stored config)")


# ---------------------------------------------------------------------------------------------
# 4. the learning rate is logged by LearningRateMonitor; an old checkpoint resumes
# ---------------------------------------------------------------------------------------------
def test_learning_rate_is_logged_per_param_group_and_an_old_checkpoint_resumes(tiny_shapes_world, tmp_path):
    """A run stopped after its first epoch, whose checkpoint's stored config is made to hold the removed
    keys, resumes with ``resume=``; ``train/lr/{decay,no_decay}`` follow the linear schedule
    ``lr_s = lr · (T − s) / T`` (no warmup, T = 4 steps) over both parts."""
    import lightning as L

    from unicon.loggers import read_metrics
    from unicon.training.run import compose_run, train

    class StopAfterFirstEpoch(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = True

    overrides = [f"data.root={tiny_shapes_world}", f"output_dir={tmp_path}", "name=lr", "model=ofa_shapes_tiny",
                 "trainer=cpu", "logger=csv", "eval=none", "loss=none", "loss.gamma=0", "data.batch_size=4",
                 "trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.log_every_n_steps=1",
                 "trainer.enable_progress_bar=false", "optim.lr=1e-3", "optim.warmup_ratio=0", "optim.scheduler=linear"]
    first = train(compose_run(overrides, announce=False), extra_callbacks=[StopAfterFirstEpoch()])
    assert first["global_step"] == 2
    ckpt_path = Path(first["ckpt_path"])
    ckpt = torch.load(ckpt_path, weights_only=True)
    for key in REMOVED_KEYS:
        section, _, leaf = key.partition(".")
        ckpt["unicon_config"][section][leaf] = 0
    torch.save(ckpt, ckpt_path)

    resumed = train(compose_run([f"resume={ckpt_path}"], announce=False))
    assert resumed["global_step"] == 4
    rows = read_metrics(Path(resumed["run_dir"]) / "metrics.jsonl")
    lr_rows = [r for r in rows if any(k.startswith("train/lr") for k in r)]
    assert all(set(r) == {"step", "time", "train/lr/decay", "train/lr/no_decay"} for r in lr_rows), lr_rows
    eps = torch.finfo(torch.float64).eps  # the schedule is float64 Python arithmetic
    assert [r["step"] for r in lr_rows] == [0, 1, 2, 3]  # one row per step, none repeated by the resume
    for row in lr_rows:
        for group in ("decay", "no_decay"):
            expected = 1e-3 * (4 - row["step"]) / 4
            assert row[f"train/lr/{group}"] == pytest.approx(expected, rel=4 * eps, abs=0), row


def test_make_demos_two_rows_share_one_wandb_group():
    """Row K (``shapes_demo_control``) extends row M's file, so W&B shows the demo's two runs as one group,
    whichever logger the command line picks."""
    assert compose(["experiment=shapes_demo"]).logger.group == "shapes_demo"
    assert compose(["experiment=shapes_demo_control", "logger=csv"]).logger.group == "shapes_demo"
    assert compose(["experiment=shapes_demo", "logger.group=mine"]).logger.group == "mine"
