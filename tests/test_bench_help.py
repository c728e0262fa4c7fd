"""``--help`` is fast: every ``unicon ... --help`` answers without importing a heavy library, and
``unicon bench help`` times every command's ``--help`` in fresh processes (one JSON object).

No timing is asserted (machines are noisy); what makes a ``--help`` slow is pinned instead: a
command's module (``unicon.cli.COMMANDS``; for ``evaluate``, every suite's module) that imports
torch, Lightning, DeepSpeed, diffusers or transformers at import time. Each of them takes one to
ten seconds to import, against a 1 s budget for a ``--help``; the commands import them in the
functions that run the steps needing them.

A standalone evaluation goes further: it reaches its first model batch without Lightning, DeepSpeed
or diffusers (its loggers are made after the evaluation; transformers comes with the OFA model), and
``unicon bench first-batch`` times that against the same run with Lightning imported first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unicon import config, core
from unicon.bench import first_batch
from unicon.bench import help as bench_help
from unicon.cli import COMMANDS, _usage
from unicon.evaluation import suites

#: what no command's module may import at import time (package names, submodules included)
HEAVY = ("torch", "lightning", "deepspeed", "diffusers", "transformers")
FIRST_PARTY = ("unicon", "data_builders")


#: ``unicon <words> --help`` in a fresh interpreter, after importing the command's modules with the
#: ``import`` statement (which ``-X importtime`` reports nested, unlike ``importlib.import_module``)
HELP = "import sys\nfor m in sys.argv[1].split():\n    __import__(m)\nfrom unicon.cli import main\nsys.exit(main(sys.argv[2:]))"


def _commands(table: dict = COMMANDS, prefix: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Every command and command group below ``unicon`` (``""``: ``unicon`` itself, first), each with
    the modules that answer its ``--help``; ``unicon evaluate``'s suites from the suite registry."""
    found = {" ".join(prefix): ["unicon.cli"]}
    for name, entry in table.items():
        words = " ".join((*prefix, name))
        if isinstance(entry, dict):
            found.update(_commands(entry, (*prefix, name)))
        elif entry[0] == "unicon.evaluation.suites":  # the group's usage and every suite import every suite
            for command in [words, *(f"{words} {s}" for s in [*suites.suites(), "all"])]:
                found[command] = [entry[0], *suites.IN_TREE]
        else:
            found[words] = [entry[0]]
    return found


COMMAND_MODULES = _commands()


def importers(importtime: str, package: str) -> list[str]:
    """From ``python -X importtime``'s report (stderr), the chain of modules through which ``package``
    was first imported, outermost first, ending with the package: first-party modules by name, other
    packages by their top-level name, e.g. ``["unicon.evaluation.cococon.suite", "unicon.loggers",
    "lightning", "torch"]``; ``[]`` if it never was. The report lists each module after the ones it
    imported, two spaces deeper per level."""
    rows = []
    for line in importtime.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.split("|")[2][1:]
            rows.append((len(name) - len(name.lstrip()), name.strip()))
    first = next((i for i, (_, n) in enumerate(rows) if n == package or n.startswith(package + ".")), None)
    if first is None:
        return []
    chain, depth = [package], rows[first][0]
    for level, name in rows[first + 1:]:
        if level < depth:  # the next shallower row is the module that imported this one
            depth = level
            top = name.split(".")[0]
            link = name if top in FIRST_PARTY else top
            if link != chain[0]:
                chain.insert(0, link)
    return chain


@pytest.mark.parametrize("command", list(COMMAND_MODULES), ids=lambda c: c or "unicon")
def test_help_exits_0_and_no_command_module_imports_a_heavy_library(command):
    """In a fresh interpreter, import the command's modules (:data:`COMMAND_MODULES`), then run
    ``unicon <command> --help``: exit 0, its usage on stdout, and none of :data:`HEAVY` imported; a
    failure names the module that imports one and the chain to it."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", HELP, " ".join(COMMAND_MODULES[command]),
                           *command.split(), "--help"], capture_output=True, text=True, timeout=300)
    errors = "\n".join(ln for ln in done.stderr.splitlines() if not ln.startswith("import time:"))
    assert done.returncode == 0, f"unicon {command} --help exited {done.returncode}:\n{errors[-2000:]}"
    assert f"usage: unicon {command}".rstrip() in done.stdout, done.stdout[:300]
    chains = [importers(done.stderr, package) for package in HEAVY]
    found = [f"{next((m for m in reversed(chain) if m.split('.')[0] in FIRST_PARTY), '?')} imports {chain[-1]} "
             f"at import time ({' > '.join(chain)})" for chain in chains if chain]
    assert found == [], f"unicon {command} --help: " + "; ".join(found)


def test_importers_names_the_first_party_module_that_imports_a_package():
    report = "\n".join(f"import time: {1:>9} | {1:>10} | {name}" for name in [
        "        torch.nn", "      torch", "    lightning.fabric", "    lightning", "  lightning.pytorch",
        "  unicon.jsonsafe", "unicon.loggers", "  numpy", "unicon.evaluation.cococon.suite"])
    assert importers(report, "lightning") == ["unicon.loggers", "lightning"]
    assert importers(report, "torch") == ["unicon.loggers", "lightning", "torch"]
    assert importers(report, "numpy") == ["unicon.evaluation.cococon.suite", "numpy"]
    assert importers(report, "transformers") == []


def test_help_constants_in_the_config_match_their_sources():
    """The flag defaults and choices that ``unicon.config`` holds (so that a parser needs no torch)
    are those of the code that uses them."""
    from unicon.evaluation.cococon.metrics import MAX_K
    from unicon.evaluation.drift.metrics import CHAINS
    from unicon.evaluation.editing.metrics import EPS
    from unicon.evaluation.editing.runner import BATCH_SIZE

    assert set(config.JUDGE_DTYPES) == {*core.DTYPES, "auto"}
    assert (MAX_K, CHAINS, EPS, BATCH_SIZE) == (config.COCOCON_MAX_K, config.DRIFT_CHAINS, config.EDITING_EPS,
                                                config.EditingEvalConfig.batch_size)


def test_listed_reads_the_commands_of_a_usage_page():
    assert bench_help.listed(_usage(COMMANDS, "unicon")) == list(COMMANDS)
    assert bench_help.listed(_usage(COMMANDS["bench"], "unicon bench")) == list(COMMANDS["bench"])
    assert bench_help.listed(suites.usage()) == [*suites.suites(), "all"]
    assert bench_help.listed("usage: unicon report RUN\n\noptions:\n  -h, --help  show this help") == []


def test_bench_help_prints_seconds_and_modules_per_command(capsys):
    assert bench_help.cli(["--repeats", "1", "--commands", "report", "unicon evaluate cococon --help"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"repeats", "budget_seconds", "python_seconds", "commands", "slowest", "over_budget",
                           "failed"}
    assert list(result["commands"]) == ["unicon report --help", "unicon evaluate cococon --help"]
    for timing in result["commands"].values():
        assert set(timing) == {"min_seconds", "median_seconds", "min_cpu_seconds", "modules", "heavy", "returncode"}
        assert 0 < timing["min_seconds"] <= timing["median_seconds"] and timing["min_cpu_seconds"] >= 0
        assert timing["modules"] > 100 and timing["heavy"] == [] and timing["returncode"] == 0
    assert result["repeats"] == 1 and result["budget_seconds"] == 1.0 and result["failed"] == []
    assert result["python_seconds"]["min"] > 0 and result["slowest"] in result["commands"]
    assert set(result["over_budget"]) <= set(result["commands"])


def test_bench_help_fails_on_a_command_whose_help_fails(capsys):
    from unicon.errors import UserError

    with pytest.raises(UserError, match="--help failed for unicon no-such-command --help"):
        bench_help.cli(["--repeats", "1", "--commands", "no-such-command"])
    assert json.loads(capsys.readouterr().out)["failed"] == ["unicon no-such-command --help"]


# ---------------------------------------------------------------------------------------------
# A standalone evaluation's first batch: no Lightning before it (unicon bench first-batch)
# ---------------------------------------------------------------------------------------------
#: what no standalone evaluation of the OFA model imports before its first model batch
NOT_BEFORE_FIRST_BATCH = ("lightning", "deepspeed", "diffusers")


@pytest.fixture(scope="module")
def tiny_model(tiny_shapes_world, tmp_path_factory) -> tuple[Path, Path]:
    """``(world, checkpoint)``: the tiny ShapesWorld and a random-weight tiny OFA saved for it."""
    import torch

    from unicon.models import build_model

    torch.manual_seed(0)
    model = build_model(config.compose(["model=ofa_shapes_tiny", f"data.root={tiny_shapes_world}"]).model,
                        world_root=tiny_shapes_world)
    ckpt = tmp_path_factory.mktemp("first_batch") / "model"
    model.save_pretrained(str(ckpt))
    return tiny_shapes_world, ckpt


def test_a_standalone_evaluation_imports_no_lightning_before_its_first_batch(tiny_model, tmp_path):
    """``unicon evaluate cococon --logger none`` in a fresh interpreter, stopped at the model's first
    call (:data:`unicon.bench.first_batch.ENTRY`): none of :data:`NOT_BEFORE_FIRST_BATCH` is imported
    by then; a failure names the module that imports one and the chain to it."""
    world, ckpt = tiny_model
    data, out = world / "cococon_test.json", tmp_path / "out"
    evaluate = first_batch.evaluate_args(str(ckpt), str(data), 2, str(out))
    argv = first_batch.first_batch_argv(evaluate, importtime=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    call = first_batch.first_call(done.stderr)
    errors = "\n".join(ln for ln in done.stderr.splitlines() if not ln.startswith("import time:"))
    assert call is not None, f"exit {done.returncode} before the first model call:\n{errors[-2000:]}"
    before = done.stderr.split(first_batch.MARK)[0]  # the imports finished before the first model call
    found = []
    for package in NOT_BEFORE_FIRST_BATCH:
        chain = importers(before, package)
        assert bool(chain) == (package in call["heavy"]), (package, chain, call["heavy"])
        if chain:
            module = next((m for m in reversed(chain) if m.split(".")[0] in FIRST_PARTY), "?")
            found.append(f"{module} imports {package} before the first batch ({' > '.join(chain)})")
    assert found == [], "unicon evaluate cococon: " + "; ".join(found)


def test_bench_first_batch_times_both_variants(tiny_model, capsys):
    world, ckpt = tiny_model
    assert first_batch.cli(["--ckpt", str(ckpt), "--data", str(world / "cococon_test.json"), "--repeats", "1",
                            "--warmup", "0", "--max-samples", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"command", "repeats", "warmup", "as_is", "lightning_first", "difference_seconds",
                           "ratio", "machine"}
    for variant in ("as_is", "lightning_first"):
        timing = result[variant]
        assert set(timing) == {"median_seconds", "seconds", "median_cpu_seconds", "modules_at_first_call",
                               "first_call", "heavy_at_first_call"}
        assert timing["median_seconds"] > 0 and timing["median_cpu_seconds"] > 0
        assert len(timing["seconds"]) == 1
        assert timing["first_call"] in first_batch.MODEL_CALLS
    assert "lightning" not in result["as_is"]["heavy_at_first_call"]
    assert "lightning" in result["lightning_first"]["heavy_at_first_call"]
    assert result["lightning_first"]["modules_at_first_call"] > result["as_is"]["modules_at_first_call"] > 100
    a, b = result["as_is"]["median_seconds"], result["lightning_first"]["median_seconds"]
    assert result["difference_seconds"] == pytest.approx(b - a) and result["ratio"] == pytest.approx(b / a)
    assert result["machine"]["cpus"] >= 1 and len(result["machine"]["load_average_before"]) == 3
