"""An out-of-tree evaluation suite, installed the way a package installs one: a ``toy_plugin``
package and its ``toy_plugin-0.0.dist-info`` (``entry_points.txt`` naming ``toy_plugin.suite`` in
the ``unicon.suites`` group) in a folder on ``sys.path``. Its module declares the suite ``toy`` (an
eval dataclass, ``load`` and ``run``, a report section) and nothing else; without a file of the
project changing, the suite gets ``unicon evaluate toy`` with ``--shard``/``--merge``, typed
``eval.toy.<key>=...`` overrides, its epoch-end callback in a training run with the W&B names of its
command, its run in ``unicon evaluate all`` and its section in report.html."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unicon.config import ConfigError, compose
from unicon.evaluation import suites

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import json
from dataclasses import dataclass

from unicon.config import bounded
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalSuite, Outcome
from unicon.evaluation.suites import register


@dataclass
class ToyEvalConfig:
    enabled: bool = False
    every_n_epochs: int = 1
    n: int = bounded(1, 1)


class ToySuite(EvalSuite):
    name, help, config = "toy", "a toy plugin suite", ToyEvalConfig
    flags = {"n": Flag("toy items")}
    draws_images = False
    report, title, headline = "toy_plugin.report:section", "Toy suite", ("toy/score",)

    def load(self, config, args, root):
        return list(range(config.n))

    def run(self, run):
        from unicon.evaluation.distributed import gather_records, owned_indices

        items = run.inputs
        mine = {i: float(items[i] * items[i]) for i in owned_indices(len(items))}  # this rank's (or shard's)
        records = gather_records(mine)  # every rank's, in index order (a merge: the shards')
        score = sum(records.values()) / len(records)
        if run.is_writer:
            (run.out / "toy.json").write_text(json.dumps({"n": len(records), "score": score}))
        return Outcome({"toy/score": score}, rows=[[i, v] for i, v in records.items()], columns=["item", "value"],
                       summary=f"toy: score {score}")


register(ToySuite())
'''

REPORT = '''
from unicon.evaluation import html as h


def section(run_dir):
    evals = h.suite_outputs(run_dir, "toy", "toy.json")
    if not evals:
        return h.not_evaluated("toy", "toy.json")
    rows = [[f"<td>{h.esc(label)}</td>", h.td(h.read_json(out / "toy.json")["n"])] for label, out in evals]
    return h.table(["evaluation", "toy n"], rows, "toy-trend")
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The folder holding the installed toy plugin, on ``sys.path``; afterwards the suite and its
    modules are gone again."""
    site = tmp_path / "site"
    pkg = site / "toy_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "suite.py").write_text(SUITE)
    (pkg / "report.py").write_text(REPORT)
    dist = site / "toy_plugin-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy_plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[{suites.SUITE_ENTRY_POINTS}]\ntoy = toy_plugin.suite\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    suites._SUITES.pop("toy", None)
    for name in [m for m in sys.modules if m == "toy_plugin" or m.startswith("toy_plugin.")]:
        del sys.modules[name]


def test_without_the_plugin_its_section_is_an_unknown_key():
    assert "toy" not in suites.suites()
    with pytest.raises(ConfigError, match="eval.toy"):
        compose(["eval.toy.enabled=true"])


def test_a_suite_declares_its_config_dataclass():
    from unicon.evaluation.framework import EvalSuite

    class NoConfig(EvalSuite):
        name, help = "nowhere-suite", "no config"

    with pytest.raises(ValueError, match="NoConfig: a suite declares its name and its config dataclass"):
        suites.register(NoConfig())
    assert "nowhere-suite" not in suites.suites()


def test_the_entry_point_registers_the_suite(plugin):
    toy = suites.suite("toy")
    assert toy.section == "toy" and toy.config.__name__ == "ToyEvalConfig" and toy.title == "Toy suite"
    assert list(suites.suites())[-1] == "toy"  # after the in-tree suites
    assert "  toy          a toy plugin suite" in suites.usage()


def test_unicon_evaluate_toy_help_imports_no_torch(plugin):
    code = ("import sys\nfrom unicon.cli import main\n"
            "try:\n    main(['evaluate', 'toy', '--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(REPO / "src")]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: unicon evaluate toy" in done.stdout and "toy items" in done.stdout
    assert done.stdout.rstrip().endswith("no torch")


def test_compose_types_and_validates_the_plugin_section(plugin):
    cfg = compose(["eval=none", "eval.toy.enabled=true", "eval.toy.n=3"])
    assert cfg.eval.toy.enabled is True and cfg.eval.toy.n == 3 and isinstance(cfg.eval.toy.n, int)
    assert compose([]).eval.toy.n == 1  # the dataclass default
    with pytest.raises(ConfigError, match=r"command line: invalid key 'eval\.toy\.n'"):
        compose(["eval.toy.n=many"])
    with pytest.raises(ConfigError, match=r"eval\.toy\.bogus"):
        compose(["eval.toy.bogus=1"])
    with pytest.raises(ConfigError, match=r"command line: eval\.toy\.n=0 is out of range"):
        compose(["eval.toy.n=0"])


@pytest.fixture
def ckpt(tmp_path):
    import standins

    path = tmp_path / "ckpt"
    standins.FakeModel().save_pretrained(str(path))
    return path


def test_a_training_run_evaluates_the_plugin_at_epoch_end(plugin, tmp_path):
    """The plugin's callback, built from ``eval.toy``, runs at the epoch end of a training run and
    logs the names its command logs."""
    import lightning.pytorch as pl
    import torch

    import standins
    from unicon.loggers import JsonlLogger, read_metrics
    from unicon.training.trainer import make_eval_callbacks

    (callback,) = make_eval_callbacks(compose(["eval=none", "eval.toy.enabled=true", "eval.toy.n=4",
                                               "eval.fail_on_error=true"]))
    assert callback.name == "toy" and callback.config.n == 4
    assert make_eval_callbacks(compose(["eval=none"])) == []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = standins.FakeModel()

        def training_step(self, batch, batch_idx):
            return (self.model.scale * batch).sum() * 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    run = tmp_path / "run"
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=JsonlLogger(run), callbacks=[callback],
                         default_root_dir=run, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=1))
    logged = {k: v for row in read_metrics(run / "metrics.jsonl") for k, v in row.items()}
    assert logged["toy/score"] == (0 + 1 + 4 + 9) / 4 and logged["toy/failed"] == 0.0
    assert json.loads((run / "eval" / "toy" / "epoch-1" / "toy.json").read_text()) == {"n": 4, "score": 3.5}


def test_the_plugin_command_shards_merges_and_logs_its_names(plugin, ckpt, tmp_path, capsys):
    from unicon.cli import main
    from unicon.loggers import read_metrics

    common = ["evaluate", "toy", "--ckpt", str(ckpt), "--device", "cpu", "--logger", "csv", "--n", "5"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert "toy: score 6.0" in capsys.readouterr().out
    for shard in ("0/2", "1/2"):
        assert main([*common, "--out", str(tmp_path / "split"), "--shard", shard]) == 0
    assert not (tmp_path / "split" / "toy.json").exists()  # a shard writes no results file
    assert main([*common, "--out", str(tmp_path / "split"), "--merge"]) == 0
    for out in ("one", "split"):
        assert json.loads((tmp_path / out / "toy.json").read_text()) == {"n": 5, "score": 6.0}
        logged = {k for row in read_metrics(tmp_path / out / "metrics.jsonl") for k in row}
        assert "toy/score" in logged
    table = (tmp_path / "one" / "tables" / "toy_samples.jsonl").read_text().splitlines()
    assert [json.loads(r)["value"] for r in table] == [0.0, 1.0, 4.0, 9.0, 16.0]
    capsys.readouterr()
    assert main([*common[:-2], "--n", "0", "--out", str(tmp_path / "bad")]) == 2  # checked by the config's range
    assert "--n must be >= 1, got 0" in capsys.readouterr().err


def test_unicon_evaluate_all_runs_the_plugin(plugin, ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert suites.all_cli(["--ckpt", str(ckpt), "--out", str(out), "--logger", "none", "--device", "cpu", "eval=none",
                           "eval.toy.enabled=true", "eval.toy.n=3"]) == 0
    assert json.loads((out / "toy" / "toy.json").read_text()) == {"n": 3, "score": 5 / 3}
    assert "ran toy" in capsys.readouterr().out


def test_report_html_renders_the_plugin_section(plugin, tmp_path):
    from unicon.report import render_html, sections

    run = tmp_path / "run"
    for epoch, n in ((1, 5), (2, 7)):
        (run / "eval" / "toy" / f"epoch-{epoch}").mkdir(parents=True)
        (run / "eval" / "toy" / f"epoch-{epoch}" / "toy.json").write_text(json.dumps({"n": n}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0, "toy/score": 0.25}) + "\n")
    assert sections()[-2:] == (("toy", "Toy suite"), ("config", "Run config"))
    page = render_html(run)
    assert '<a href="#toy">Toy suite</a>' in page
    body = page.split('<section id="toy"><h2>Toy suite</h2>', 1)[1].split("</section>", 1)[0]
    assert 'class="toy-trend"' in body and '<td class="num">5</td>' in body and '<td class="num">7</td>' in body
    assert "<td>toy/score</td>" in page.split('<section id="summary">', 1)[1].split("</section>", 1)[0]


def test_a_baseline_comparison_leaves_out_a_suite_without_compare(plugin, tmp_path):
    """The toy suite's report module defines no ``compare``: ``unicon report --baseline`` compares the
    runs through the suites that do (CocoCon) and leaves it out, also from a baseline's error."""
    from unicon.errors import UserError
    from unicon.report import render_html

    assert not hasattr(suites.suite("toy").report_module(), "compare")
    for name, row in (("M", {"cococon/vqa/C_1": 90.0, "cococon/vqa/rho": 0.5}),
                      ("K", {"cococon/vqa/C_1": 85.0, "cococon/vqa/rho": 0.5}), ("T", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 10, "toy/score": 0.5, **row}) + "\n")
    summary = render_html(tmp_path / "M", baseline=tmp_path / "K").split('<section id="summary">', 1)[1]
    summary = summary.split("</section>", 1)[0]
    assert summary.count("<table") == 2 and '<table class="comparison">' in summary  # and the headline table
    assert '<td class="num ok">5</td>' in summary
    with pytest.raises(UserError, match=r"^baseline \S+T: no CocoCon C_1 and rho logged for a task[^;]*$"):
        render_html(tmp_path / "M", baseline=tmp_path / "T")
