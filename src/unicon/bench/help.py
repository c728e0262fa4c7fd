"""``unicon bench help``: how fast every ``unicon`` command answers ``--help``.

Each ``unicon ... --help`` runs in a fresh Python process, as the ``unicon`` console script runs it
(``from unicon.cli import main``), ``--repeats`` times, all commands in turn within each repeat
(these machines are noisy: the commands are compared side by side, never timed one after another).
Per command: the least and the median wall-clock seconds, the least CPU seconds of the process
(less sensitive to other jobs on the machine), the number of modules it had imported when it exited
and the heavy libraries among them (:data:`HEAVY`). Beside them, ``python_seconds``: a bare
interpreter start, the floor under every command. The goal is every ``--help`` within ``--budget``
seconds (1 s); ``over_budget`` lists the commands whose fastest run is slower.

The commands are found by asking the CLI itself: ``unicon --help`` lists the commands and the
groups, ``unicon <group> --help`` the commands of a group (``unicon evaluate --help``: the suites,
plugins included); ``--commands`` times only the ones named. Prints one JSON object; a ``--help``
that fails is an error (exit 2) after the JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Sequence

from unicon.errors import UserError

#: libraries that no ``--help`` needs (each costs a second or more to import)
HEAVY = ("torch", "lightning.pytorch", "deepspeed", "diffusers", "transformers", "torchmetrics", "torchvision",
         "matplotlib", "wandb")
#: the first word of the line the timed process writes last on stderr
MARK = "unicon-bench-help:"
#: what the ``unicon`` console script runs, plus, when the process exits, ``MARK <modules> <heavy ...>``
ENTRY = f"""\
import atexit, sys

def report():
    heavy = [name for name in {HEAVY!r} if name in sys.modules]
    print({MARK!r}, len(sys.modules), *heavy, file=sys.stderr)

atexit.register(report)
from unicon.cli import main
sys.exit(main())
"""


def listed(usage: str) -> list[str]:
    """The names a ``unicon`` usage page lists under ``commands:`` or ``suites:``."""
    names, inside = [], False
    for line in usage.splitlines():
        if line in ("commands:", "suites:"):
            inside = True
        elif inside and line.startswith("  ") and line.strip():
            names.append(line.split()[0])
        else:
            inside = False
    return names


def _run(argv: Sequence[str], timeout: float) -> tuple[float, float, subprocess.CompletedProcess]:
    """``(wall seconds, CPU seconds, the finished process)`` of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done


def _help_argv(command: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-c", ENTRY, *command, "--help"]


def _label(command: tuple[str, ...]) -> str:
    return " ".join(("unicon", *command, "--help"))


def discover(timeout: float = 120.0) -> list[tuple[str, ...]]:
    """Every command, ``()`` (``unicon`` itself) first and each group before its commands. Runs each
    ``--help`` once (which also warms the file cache before the timed runs)."""
    found, todo = [], [()]
    while todo:
        command = todo.pop(0)
        found.append(command)
        todo += [(*command, name) for name in listed(_run(_help_argv(command), timeout)[2].stdout)]
    return found


def _imports(stderr: str) -> tuple[int | None, list[str]]:
    """The module count and heavy libraries from the last :data:`MARK` line of ``stderr``."""
    lines = [line.split()[1:] for line in stderr.splitlines() if line.startswith(MARK)]
    if not lines:
        return None, []
    return int(lines[-1][0]), lines[-1][1:]


def run(commands: Sequence[tuple[str, ...]], repeats: int = 3, budget: float = 1.0,
        timeout: float = 120.0) -> dict:
    """The JSON object of ``unicon bench help`` (see the module docstring) for ``commands`` (tuples of
    words after ``unicon``; ``()`` is ``unicon --help``)."""
    wall: dict[tuple[str, ...], list[float]] = {c: [] for c in commands}
    cpu: dict[tuple[str, ...], list[float]] = {c: [] for c in commands}
    last: dict[tuple[str, ...], subprocess.CompletedProcess] = {}
    python: list[float] = []
    for _ in range(repeats):
        python.append(_run([sys.executable, "-c", "pass"], timeout)[0])
        for command in commands:
            seconds, cpu_seconds, last[command] = _run(_help_argv(command), timeout)
            wall[command].append(seconds)
            cpu[command].append(cpu_seconds)
    results = {}
    for command in commands:
        modules, heavy = _imports(last[command].stderr)
        results[_label(command)] = {
            "min_seconds": min(wall[command]), "median_seconds": statistics.median(wall[command]),
            "min_cpu_seconds": min(cpu[command]), "modules": modules, "heavy": heavy,
            "returncode": last[command].returncode,
        }
    return {
        "repeats": repeats,
        "budget_seconds": budget,
        "python_seconds": {"min": min(python), "median": statistics.median(python)},
        "commands": results,
        "slowest": max(results, key=lambda c: results[c]["min_seconds"]),
        "over_budget": [c for c, r in results.items() if r["min_seconds"] > budget],
        "failed": [c for c, r in results.items() if r["returncode"] != 0],
    }


def _command(text: str) -> tuple[str, ...]:
    """``"evaluate cococon"`` (or ``"unicon evaluate cococon --help"``) -> ``("evaluate", "cococon")``."""
    words = text.split()
    if words[:1] == ["unicon"]:
        words = words[1:]
    if words[-1:] == ["--help"]:
        words = words[:-1]
    return tuple(words)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unicon bench help", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each command (default: %(default)s)")
    parser.add_argument("--commands", nargs="+", default=None, metavar="COMMAND",
                        help='only these, e.g. "evaluate cococon" report ("" is unicon itself; default: every '
                             "command the CLI lists)")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds a --help may take; slower ones are listed in over_budget (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a run counts as hung")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.budget <= 0 or args.timeout <= 0:
        raise UserError("bench help: need --repeats >= 1, --budget > 0 and --timeout > 0")
    commands = [_command(c) for c in args.commands] if args.commands else discover(args.timeout)
    result = run(commands, args.repeats, args.budget, args.timeout)
    print(json.dumps(result, indent=1))
    if result["failed"]:
        raise UserError(f"bench help: --help failed for {', '.join(result['failed'])}")
    return 0
