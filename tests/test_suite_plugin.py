"""An out-of-tree evaluation suite, installed the way a package installs one: a ``toy_plugin``
package and its ``toy_plugin-0.0.dist-info`` (``entry_points.txt`` naming ``toy_plugin.cli`` in
the ``unicon.suites`` group) in a folder on ``sys.path``. Its module registers the suite ``toy``
with an eval dataclass, an epoch-end callback and a report section; without a file of the project
changing, the suite gets ``unicon evaluate toy``, typed ``eval.toy.<key>=...`` overrides, its
callback in a training run, its run in ``unicon evaluate all`` and its section in report.html."""

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

CLI = '''
import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from unicon.config import bounded
from unicon.evaluation.suites import register_suite


@dataclass
class ToyEvalConfig:
    enabled: bool = False
    n: int = bounded(1, 1)


def argv_from_config(cfg):
    return ["--n", str(cfg.eval.toy.n)]


@register_suite("toy", "a toy plugin suite", section="toy", argv=argv_from_config, config=ToyEvalConfig,
                callback="toy_plugin.callback:ToyCallback", report="toy_plugin.report:section",
                title="Toy suite", headline=("toy/score",), shardable=False)
def cli(argv=None):
    p = argparse.ArgumentParser(prog="unicon evaluate toy", description="the toy suite")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=1, help="toy items")
    p.add_argument("--device")
    p.add_argument("--logger")
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "toy.json").write_text(json.dumps({"n": args.n, "ckpt": args.ckpt}))
    return 0
'''

CALLBACK = '''
class ToyCallback:
    def __init__(self, n):
        self.n = n

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.eval.toy.n)
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
    (pkg / "cli.py").write_text(CLI)
    (pkg / "callback.py").write_text(CALLBACK)
    (pkg / "report.py").write_text(REPORT)
    dist = site / "toy_plugin-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy_plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[{suites.SUITE_ENTRY_POINTS}]\ntoy = toy_plugin.cli\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    suites._SUITES.pop("toy", None)
    for name in [m for m in sys.modules if m == "toy_plugin" or m.startswith("toy_plugin.")]:
        del sys.modules[name]


def test_without_the_plugin_its_section_is_an_unknown_key():
    assert "toy" not in suites.suites()
    with pytest.raises(ConfigError, match="eval.toy"):
        compose(["eval.toy.enabled=true"])


def test_a_section_outside_the_eval_config_needs_its_dataclass():
    with pytest.raises(ValueError, match="eval.nowhere is no field of EvalConfig: pass config="):
        suites.register_suite("nowhere-suite", "no config", section="nowhere")(lambda argv=None: 0)
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


def test_a_training_run_builds_the_plugin_callback(plugin):
    from unicon.training.trainer import make_eval_callbacks

    (callback,) = make_eval_callbacks(compose(["eval=none", "eval.toy.enabled=true", "eval.toy.n=4"]))
    assert type(callback).__name__ == "ToyCallback" and callback.n == 4
    assert make_eval_callbacks(compose(["eval=none"])) == []


def test_unicon_evaluate_all_runs_the_plugin(plugin, tmp_path, capsys):
    out = tmp_path / "out"
    assert suites.all_cli(["--ckpt", "model", "--out", str(out), "eval=none", "eval.toy.enabled=true",
                           "eval.toy.n=3"]) == 0
    assert json.loads((out / "toy" / "toy.json").read_text()) == {"n": 3, "ckpt": "model"}
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
