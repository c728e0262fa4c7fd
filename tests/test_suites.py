"""The suite registry and the generated ``unicon evaluate`` flags: every suite is reachable through
``unicon evaluate <name>``; a suite registered from a test module runs without an edit to ``src/``;
the flags of ``eval.<suite>`` are its fields with the config's defaults (the documented standalone
exceptions aside) and round-trip a composed config; ``unicon evaluate all eval=<group>`` runs the
suites the group enables with its settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import standins
from unicon import config
from unicon.cli import main as unicon_main
from unicon.errors import UserError
from unicon.evaluation import suites
from unicon.evaluation.cli_common import Flag, add_config_args, config_argv, config_from_args
from unicon.evaluation.framework import EvalSuite

#: suite -> the arguments it requires besides --ckpt and --out
REQUIRED = {"cococon": ["--data", "d"], "drift": [], "ureason": ["--data", "d"], "shapes": [],
            "realunify": ["--data", "d"], "alignment": ["--data", "d"], "editing": ["--data", "d"]}


def generated(name):
    """(its section class, its parser, its flags, fields without a flag, required arguments)"""
    s = suites.suite(name)
    return s.config, s.parser, s.flags, s.skip, REQUIRED[name]


def test_in_tree_suites_are_registered_in_order():
    assert list(suites.suites())[:4] == ["cococon", "drift", "ureason", "shapes"]
    assert {s.section for s in suites.suites().values()} >= {"cococon", "drift", "ureason"}
    with pytest.raises(UserError, match="unknown evaluation suite 'nope' .*cococon, drift, ureason, shapes"):
        suites.evaluate_cli(["nope"])


def test_a_suite_registered_from_a_test_module_runs_through_unicon_evaluate(capsys, monkeypatch):
    suites.suites()  # every suite registered first: the test's suite is gone after the test
    monkeypatch.setattr(suites, "_SUITES", dict(suites._SUITES))

    @dataclasses.dataclass
    class RegistryTestConfig:
        enabled: bool = False
        every_n_epochs: int = 1
        x: int = 1

    class RegistryTestSuite(EvalSuite):
        name, help, config = "registry-test-suite", "a suite defined in a test", RegistryTestConfig

    suites.register(RegistryTestSuite())
    with pytest.raises(SystemExit):
        unicon_main(["evaluate", "registry-test-suite", "--help"])
    assert "--x X" in capsys.readouterr().out
    assert "registry-test-suite" in (unicon_main(["evaluate", "--help"]), capsys.readouterr().out)[1]
    suites.register(RegistryTestSuite())  # the same suite again: a re-import

    class Another(RegistryTestSuite):
        pass

    with pytest.raises(ValueError, match="already registered"):
        suites.register(Another())


@pytest.mark.parametrize("suite", list(REQUIRED))
def test_flag_defaults_are_the_config_defaults(suite):
    cls, parser, flags, skip, required = generated(suite)
    args = parser().parse_args(["--ckpt", "c", "--out", "o", *required])
    got = dataclasses.asdict(config_from_args(args, cls, flags, skip))
    want = dataclasses.asdict(cls())
    overridden = {name for name, spec in flags.items() if spec.default != Flag().default or spec.required}
    assert {k: v for k, v in got.items() if k not in overridden} == {k: v for k, v in want.items() if k not in overridden}
    assert overridden <= {"data", "max_samples", "num_chains"}  # the documented standalone exceptions
    assert args.device is None and args.logger == config.LoggerConfig.type  # device: check_common_args
    flags_text = parser().format_help()
    assert all(f"--{f.name.replace('_', '-')}" in flags_text or f.name in flags or f.name in skip
               for f in dataclasses.fields(cls) if f.name not in ("enabled", "every_n_epochs"))


@pytest.mark.parametrize("suite", list(REQUIRED))
def test_a_composed_eval_section_round_trips_through_the_flags(suite):
    cls, parser, flags, skip, required = generated(suite)
    cfg = config.compose(["eval=shapes", f"eval.{suite}.batch_size=3"])
    argv = suites.suite(suite).argv(cfg)
    args = parser().parse_args(["--ckpt", "c", "--out", "o", *argv])
    got = dataclasses.asdict(config_from_args(args, cls, flags, skip))
    section = config.OmegaConf.to_container(cfg.eval[suite], resolve=True)
    for name, value in got.items():
        if name in ("enabled", "every_n_epochs", *skip) or (section[name] is None and name in ("data", "seeds")):
            continue
        assert value == section[name], name
    assert got["batch_size"] == 3


def test_bad_flag_values_name_the_flag():
    import argparse

    drift = suites.suite("drift")
    p = argparse.ArgumentParser()
    add_config_args(p, config.DriftEvalConfig, drift.flags, skip=drift.skip)
    with pytest.raises(UserError, match="--generations must be >= 1, got 0"):
        config_from_args(p.parse_args(["--generations", "0"]), config.DriftEvalConfig, drift.flags, drift.skip)
    with pytest.raises(UserError, match="--embedders 'sift' is not one of: scene, clip, text, dino"):
        config_from_args(p.parse_args(["--embedders", "scene,sift"]), config.DriftEvalConfig, drift.flags,
                         drift.skip)
    with pytest.raises(SystemExit):  # argparse: not an int
        p.parse_args(["--strips", "two"])
    assert config_argv({"batch_size": 2, "generative": False, "tasks": ["vqa"], "probe_words": [], "data": None,
                        "images_root": None, "max_samples": 5, "table_rows": 1, "skip_missing": True},
                       config.CocoConEvalConfig, suites.suite("cococon").flags) == [
        "--max-samples=5", "--batch-size=2", "--no-generative", "--table-rows=1", "--skip-missing", "--tasks", "vqa",
        "--probe-words"]


def test_evaluate_all_runs_the_groups_suites(tmp_path, capsys):
    world = standins.build_world(tmp_path / "world")
    ckpt = tmp_path / "ckpt"
    standins.FakeModel(captions="world", draw="world", world=str(world)).save_pretrained(str(ckpt))
    common = ["evaluate", "all", "--ckpt", str(ckpt), "--device", "cpu", "--logger", "none"]
    quick = [f"data.root={world}", "eval.drift.embedders=[scene]", "eval.drift.generations=1",
             "eval.cococon.max_samples=3", "eval.ureason.max_samples=2"]
    assert unicon_main([*common, "--out", str(tmp_path / "all"), "eval=shapes", *quick]) == 0
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["cococon", "drift", "ureason"]
    assert json.loads((tmp_path / "all" / "cococon" / "results.json").read_text())["num_samples"] == 3
    drift = json.loads((tmp_path / "all" / "drift" / "drift.json").read_text())
    assert drift["generations"] == 1 and drift["num_chains"] == 2 and "MGG" in drift  # eval.drift.geneval: true
    assert json.loads((tmp_path / "all" / "ureason" / "ureason.json").read_text())["max_samples"] == 2
    # the group decides which suites run
    assert unicon_main([*common, "--out", str(tmp_path / "only"), "eval=cococon_only", *quick,
                        f"eval.cococon.data={world / 'cococon_test.json'}"]) == 0
    assert [p.name for p in (tmp_path / "only").iterdir()] == ["cococon"]
    assert unicon_main([*common, "--out", str(tmp_path / "none"), "eval=none", *quick]) == 2
    assert "enables no suite" in capsys.readouterr().err


def test_every_results_file_records_commit_versions_fingerprint_and_generation(tmp_path, capsys, monkeypatch):
    from unicon import loggers
    from unicon.core import weights_fingerprint

    state = loggers.git_state()  # others may commit meanwhile: the runs and the check see one state
    monkeypatch.setattr(loggers, "git_state", lambda: state)

    world = standins.build_world(tmp_path / "world")
    ckpt = tmp_path / "ckpt"
    model = standins.FakeModel(scale=0.5, captions="world", draw="world", world=str(world))
    model.save_pretrained(str(ckpt))
    common = ["--ckpt", str(ckpt), "--device", "cpu", "--logger", "none", "--image-seed", "7"]
    runs = {  # suite -> (its arguments, its results file, where it keeps the image-generation settings)
        "cococon": (["--data", str(world / "cococon_test.json"), "--cider-tokenizer", "simple"], "results.json",
                    ("generation", "image")),
        "drift": (["--world", str(world), "--generations", "1", "--embedders", "scene"], "drift.json",
                  ("image_generation",)),
        "ureason": (["--data", str(world), "--judge", "exact", "--max-samples", "2"], "ureason.json",
                    ("generation", "image")),
        "shapes": (["--world", str(world), "--limit", "2"], "shapes_eval.json", ("image_generation",)),
    }
    for name, (args, filename, image_key) in runs.items():
        assert unicon_main(["evaluate", name, *common, *args, "--out", str(tmp_path / name)]) == 0, name
        saved = json.loads((tmp_path / name / filename).read_text())
        assert saved["model_fingerprint"] == weights_fingerprint(model), name
        assert {"versions.python", "versions.torch", "versions.unicon"} <= set(saved["environment"]), name
        assert saved["environment"].get("git.commit") == state.get("git.commit"), name
        image = saved
        for key in image_key:
            image = image[key]
        assert image["seed"] == 7, name  # --image-seed, recorded with the rest of the recipe
    capsys.readouterr()


def test_a_training_run_builds_the_epoch_end_callbacks_the_registry_names(monkeypatch):
    """make_eval_callbacks reads the suite registry: one callback per enabled eval.<section>, in
    registry order, built by the suite; a disabled section builds none."""
    from unicon.config import compose
    from unicon.training import trainer

    from unicon.evaluation.callbacks import SuiteCallback

    monkeypatch.setattr(SuiteCallback, "from_config", classmethod(lambda cls, s, cfg: s.section))
    registered = [s.section for s in suites.suites().values()]
    assert registered == ["cococon", "drift", "ureason", "shapes", "realunify", "alignment", "editing"]
    off = ("realunify", "alignment", "editing")  # off unless their own group (or enabled=true) turns them on
    assert trainer.make_eval_callbacks(compose(["eval=shapes", "eval.shapes.enabled=true"])) == \
        [r for r in registered if r not in off]
    assert trainer.make_eval_callbacks(compose(["eval=realunify"])) == ["realunify"]
    assert trainer.make_eval_callbacks(compose(["eval=alignment"])) == ["alignment"]
    assert trainer.make_eval_callbacks(compose(["eval=editing"])) == ["editing"]
    assert trainer.make_eval_callbacks(compose(["eval=shapes"])) == [r for r in registered if r not in ("shapes", *off)]
    assert trainer.make_eval_callbacks(compose(["eval=shapes", "eval.drift.enabled=false"])) == \
        [r for r in registered if r not in ("drift", "shapes", *off)]
    assert trainer.make_eval_callbacks(compose(["eval=shapes_tasks"])) == ["shapes"]


def test_evaluate_all_shards_what_can_be_sharded_and_runs_the_rest_whole_in_shard_0(monkeypatch, tmp_path):
    """``unicon evaluate all --shard I/N`` passes --shard to every shardable suite; a suite that cannot
    be sharded (a plugin's; here a stand-in in shapes' section) runs whole in shard 0 only, and --merge
    leaves it alone."""
    calls = []

    def fake(name):
        return lambda argv: calls.append((name, list(argv))) or 0

    class Fake(EvalSuite):
        def __init__(self, name, shardable=True):
            self.name, self.shardable = name, shardable

        def cli(self, argv=None):
            return fake(self.name)(argv)

        def argv(self, run_cfg):
            return []

    registry = {"cococon": Fake("cococon"), "shapes": Fake("shapes", shardable=False)}
    monkeypatch.setattr(suites, "suites", lambda: registry)
    base = ["--ckpt", "m", "--out", str(tmp_path), "eval.cococon.enabled=true", "eval.shapes.enabled=true"]

    def run(*extra):
        calls.clear()
        assert suites.all_cli([*base, *extra]) == 0
        return {name: argv for name, argv in calls}

    first = run("--shard", "0/2")
    assert first["cococon"][:2] == ["--ckpt", "m"] and "--shard" in first["cococon"] and "0/2" in first["cococon"]
    assert "--shard" not in first["shapes"] and "--merge" not in first["shapes"]
    second = run("--shard", "1/2")
    assert "--shard" in second["cococon"] and "shapes" not in second
    merged = run("--merge")
    assert "--merge" in merged["cococon"] and "shapes" not in merged
    whole = run()
    assert "--shard" not in whole["shapes"] and "--shard" not in whole["cococon"]


def test_every_epoch_end_callback_honours_eval_fail_on_error(shipped_world):
    """``eval.fail_on_error`` reaches every suite's callback through its ``from_config`` (no suite is
    special-cased by name in the training run)."""
    from unicon.config import compose
    from unicon.training import run, trainer

    on = [f"eval.{s.section}.enabled=true" for s in suites.suites().values()]
    for flag in (True, False):
        built = trainer.make_eval_callbacks(compose(["eval=shapes", f"data.root={shipped_world}", *on,
                                                 f"eval.fail_on_error={str(flag).lower()}"]))
        assert len(built) == len(on) and all(cb.fail_on_error is flag for cb in built), \
            [(type(cb).__name__, cb.fail_on_error) for cb in built]
    for module in (run, trainer):
        source = Path(module.__file__).read_text()
        assert not [name for name in suites.suites() if f'"{name}"' in source], f"{module.__name__} names a suite"
