"""``--help`` is fast: building a command's parser imports no heavy library, and ``unicon bench help``
times every command's ``--help`` in fresh processes (one JSON object)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from unicon import config, core
from unicon.bench import help as bench_help
from unicon.cli import COMMANDS, _usage
from unicon.evaluation import suites

#: what building a parser must not import: each costs seconds (Lightning, the model backends, metrics)
HEAVY = ("torch", "lightning.pytorch", "transformers", "torchmetrics")
#: ``unicon <command> --help``, then the modules the process imported (one per line on stderr)
PRINT_MODULES = ("import sys\n"
                 "from unicon.cli import main\n"
                 "try:\n"
                 "    main(sys.argv[1:])\n"
                 "except SystemExit:\n"
                 "    pass\n"
                 "print(*sorted(sys.modules), sep='\\n', file=sys.stderr)\n")


@pytest.mark.parametrize("command", ["evaluate cococon", "evaluate drift", "evaluate ureason", "evaluate shapes",
                                     "evaluate realunify", "evaluate alignment", "evaluate editing", "evaluate all",
                                     "bench chains", "bench scoring", "bench train", "bench pretrain",
                                     "bench help"])
def test_help_imports_no_heavy_library(command):
    done = subprocess.run([sys.executable, "-c", PRINT_MODULES, *command.split(), "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: unicon {command}" in done.stdout
    modules = set(done.stderr.splitlines())
    assert "unicon.cli" in modules
    assert [m for m in HEAVY if m in modules] == []


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
