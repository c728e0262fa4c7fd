"""The suite registry: ``unicon evaluate <name>``, ``unicon evaluate all``, the epoch-end callbacks
of a training run and the sections of ``report.html`` route through it.

A suite is an :class:`~unicon.evaluation.framework.EvalSuite` (its declaration, ``load`` and ``run``;
how to write one: :mod:`unicon.evaluation.framework`), registered where it is defined with
``register(MySuite())``. Its ``report`` (``"module:function"``, a function ``(run_dir) -> str`` built
from :mod:`unicon.evaluation.html`) renders its section of ``report.html`` under ``title``, and
``headline`` lists the metrics the report's summary and curves show. The report module is imported
only when used, so listing the suites (``--help``) imports no torch. It may also define, each
optional, from a run's series of ``metrics.jsonl`` (metric name -> ``[(step, value), ...]``):
``headline_table(series) -> str | None`` (printed at the end of ``unicon train``) and, for ``unicon
report RUN --baseline RUN_K``, ``compare(series, baseline_series) -> rows`` (empty: nothing to
compare) with its renderers ``comparison_text(rows, run_name, baseline_name) -> str`` and
``comparison_html(rows, baseline, series, baseline_series) -> str`` and ``NOT_COMPARED`` (why a
baseline gave no row); a suite without them is left out of those parts.

In-tree suites are the modules of :data:`IN_TREE`, their sections fields of
:class:`unicon.config.EvalConfig`. Out-of-tree ones declare their module in the entry-point group
:data:`SUITE_ENTRY_POINTS` (``[project.entry-points."unicon.suites"] mysuite = "pkg.suite"``) and
declare ``config`` (their eval dataclass, with at least ``enabled: bool`` and ``every_n_epochs:
int``): the config module imports no suite (it sits below this one), so this module hands it a
provider of those sections (:func:`unicon.config.set_eval_sections`) when it is imported; every
config composed afterwards (``unicon train``, ``unicon evaluate all``: both import the registry
first) carries ``eval.<section>``, typed and validated by the plugin's dataclass, and a training
run builds the plugin's callback when it is enabled.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from unicon.config import EvalConfig, compose, set_eval_sections
from unicon.errors import UserError
from unicon.evaluation.framework import EvalSuite

SUITE_ENTRY_POINTS = "unicon.suites"
#: the modules whose import registers the in-tree suites
IN_TREE = tuple(f"unicon.evaluation.{name}.suite" for name in
                ("cococon", "drift", "ureason", "shapes", "realunify", "alignment", "editing"))

_SUITES: dict[str, EvalSuite] = {}
_IN_TREE_SECTIONS = frozenset(f.name for f in fields(EvalConfig) if f.name != "fail_on_error")


def register(suite: EvalSuite) -> EvalSuite:
    """Make ``suite`` ``unicon evaluate <suite.name>``, the callback of ``eval.<suite.section>`` and its
    report section. Its ``config`` dataclass is required (its fields are the flags and, for a plugin,
    the run config's section)."""
    if not suite.name or suite.config is None:
        raise ValueError(f"{type(suite).__name__}: a suite declares its name and its config dataclass")
    known = _SUITES.get(suite.name)
    if known is not None and type(known) is not type(suite):
        raise ValueError(f"suite {suite.name!r} is already registered by {type(known).__module__}")
    _SUITES[suite.name] = suite
    return suite


def _load() -> None:
    for module in IN_TREE:
        importlib.import_module(module)
    for entry_point in importlib.metadata.entry_points(group=SUITE_ENTRY_POINTS):
        if entry_point.name not in _SUITES:
            entry_point.load()


def suites() -> dict[str, EvalSuite]:
    """Every registered suite, in-tree ones first (their :data:`IN_TREE` order)."""
    _load()

    def rank(s: EvalSuite) -> int:
        module = type(s).__module__
        return IN_TREE.index(module) if module in IN_TREE else len(IN_TREE)

    return {s.name: s for s in sorted(_SUITES.values(), key=rank)}  # sorted() is stable: plugins keep their order


def plugin_sections() -> dict[str, type]:
    """``{section: dataclass}`` of the registered suites whose section is no field of ``EvalConfig``."""
    return {s.section: s.config for s in suites().values() if s.section not in _IN_TREE_SECTIONS}


set_eval_sections(plugin_sections)


def suite(name: str) -> EvalSuite:
    known = suites()
    if name not in known:
        raise UserError(f"unknown evaluation suite '{name}' (choose from {', '.join([*known, 'all'])})")
    return known[name]


def usage() -> str:
    lines = ["usage: unicon evaluate <suite> [options]", "", "suites:"]
    lines += [f"  {s.name:<12} {s.help}" for s in suites().values()]
    lines.append(f"  {'all':<12} the suites a training run's eval group enables (eval=<group>)")
    lines += ["", "Run 'unicon evaluate <suite> --help' for the options of a suite;",
              "'unicon evaluate --list-shardable' prints the suites that take --shard/--merge, one a line."]
    return "\n".join(lines)


def evaluate_cli(argv: Sequence[str] | None = None) -> int:
    """``unicon evaluate <suite> ...``: the registered suite's command. ``--list-shardable`` prints
    the names of the suites whose command takes ``--shard``/``--merge`` (:attr:`EvalSuite.shardable`),
    one a line, for scripts (``slurm/evaluate_array.sbatch``) that shard suites."""
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--list-shardable":
        if argv[1:]:
            raise UserError(f"unicon evaluate --list-shardable takes no arguments, got {' '.join(argv[1:])}")
        print("\n".join(s.name for s in suites().values() if s.shardable))
        return 0
    if argv[0] == "all":
        return all_cli(argv[1:])
    return int(suite(argv[0]).cli(argv[1:]) or 0)


def all_cli(argv: Sequence[str] | None = None) -> int:
    """``unicon evaluate all --ckpt X --out DIR eval=<group> [key=value ...]``. With ``--shard I/N``, a
    suite that cannot be sharded (a plugin without ``EvalSuite.shardable``) runs whole in shard 0 and not in the others,
    and ``--merge`` leaves it as shard 0 wrote it."""
    p = argparse.ArgumentParser(
        prog="unicon evaluate all",
        description="Run the evaluation suites that a training run's eval group enables (configs/eval/<group>.yaml), "
                    "with its settings, one folder per suite under --out.")
    p.add_argument("--ckpt", required=True, help="model: save_pretrained directory or Lightning .ckpt")
    p.add_argument("--out", required=True, help="output folder (one sub-folder per suite)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    p.add_argument("--logger", choices=["wandb", "csv", "none"], default=None, help="default: the suites' default")
    p.add_argument("--allow-pickle", action="store_true", help="accept checkpoints that need unpickling")
    p.add_argument("--shard", default=None, metavar="I/N", help="run shard I of N of every suite")
    p.add_argument("--merge", action="store_true", help="merge every suite's finished shards")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the outputs of another run in a suite's folder first (default: refuse)")
    p.add_argument("overrides", nargs="*", metavar="eval=<group> | key=value",
                   help="config choices and overrides as for `unicon train` (e.g. eval=shapes data.root=data/shapes)")
    args = p.parse_args(argv)
    cfg = compose(list(args.overrides))
    shard = None
    if args.shard is not None:
        from unicon.evaluation.distributed import Shard  # lazy: pulls in torch

        shard = Shard.parse(args.shard)
    common = ["--ckpt", args.ckpt]
    for flag, value in (("--device", args.device), ("--logger", args.logger)):
        if value is not None:
            common += [flag, value]
    common += ["--allow-pickle"] * args.allow_pickle + ["--overwrite"] * args.overwrite
    split = ["--shard", args.shard] * (shard is not None) + ["--merge"] * args.merge
    ran = []
    for s in suites().values():
        if not cfg.eval[s.section].enabled:
            continue
        if not s.shardable and (args.merge or (shard is not None and shard.index != 0)):
            print(f"unicon evaluate all: {s.name} cannot be sharded: shard 0 runs it whole")
            continue
        print(f"unicon evaluate all: {s.name}" + (" (whole: it cannot be sharded)" if not s.shardable and shard else ""))
        code = int(s.cli([*common, *(split if s.shardable else []), *s.argv(cfg),
                          "--out", str(Path(args.out) / s.name)]) or 0)
        if code:
            return code
        ran.append(s.name)
    if not ran:
        raise UserError("unicon evaluate all: the eval group enables no suite (eval.<suite>.enabled)")
    print(f"unicon evaluate all: ran {', '.join(ran)} -> {args.out}")
    return 0
