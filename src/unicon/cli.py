"""The ``unicon`` command line: train, evaluate, build-data, report, bench.

Each subcommand lives with the code it drives; this file only routes ``argv`` there:

=========================  ==============================================
``unicon train``           ``unicon.training.run.cli``
``unicon evaluate <suite>`` the suite registry, ``unicon.evaluation.suites.evaluate_cli``
                           (cococon, drift, ureason, shapes, realunify, alignment, editing,
                           plugins; ``all``: an eval group)
``unicon build-data shapes`` ``data_builders.shapes.main``
``unicon build-data cococon`` ``data_builders.cococon.main``
``unicon experiment table2`` ``unicon.experiments.table2.cli``
``unicon report``          ``unicon.report.cli``
``unicon study create``    ``unicon.study.cli.create_cli`` (also ``serve``, ``export``)
``unicon bench scoring``   ``unicon.bench.scoring.cli``
``unicon bench train``     ``unicon.bench.training.cli``
``unicon bench pretrain``  ``unicon.bench.training.pretrain_cli``
``unicon bench chains``    ``unicon.bench.chains.bench_cli``
``unicon bench build-cococon`` ``data_builders.cococon.bench_main``
``unicon bench help``      ``unicon.bench.help.cli``
``unicon bench first-batch`` ``unicon.bench.first_batch.cli``
=========================  ==============================================

Before routing, :func:`quiet_libraries` hides the library messages of :data:`LIBRARY_NOISE`, which
a user of this project cannot act on (by message: every other warning still shows).

User mistakes (:class:`unicon.errors.UserError`, :class:`unicon.config.ConfigError`, a missing
file) are printed as one line, ``unicon: error: ...``, with exit code 2. Anything else is a bug
and keeps its traceback (exit code 1). ``unicon --debug …`` or ``UNICON_DEBUG=1`` shows tracebacks for
all errors.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import warnings

from unicon import __version__
from unicon.config import ConfigError
from unicon.errors import UserError
from unicon.evaluation.preemption import Preempted

# command -> (module, function, one-line help); nested dicts are command groups
COMMANDS: dict = {
    "train": ("unicon.training.run", "cli", "train a unified model (consistency training or pretraining)"),
    "evaluate": ("unicon.evaluation.suites", "evaluate_cli",
                 "evaluate a checkpoint: {cococon,drift,ureason,shapes,realunify,alignment,editing,all} (the suite registry)"),
    "build-data": {
        "shapes": ("data_builders.shapes", "main", "build the embedded ShapesWorld datasets"),
        "cococon": ("data_builders.cococon", "main", "CocoCon contrast sets from COCO + VQAv2 (section 4.1)"),
    },
    "experiment": {
        "table2": ("unicon.experiments.table2", "cli", "CocoCon Table 2: K vs M vs hinge across seeds, paired CIs"),
    },
    "report": ("unicon.report", "cli", "summarise a run directory (metrics.jsonl + evaluation outputs)"),
    "study": {
        "create": ("unicon.study.cli", "create_cli", "a human study from drift outputs: balanced, masked, randomised"),
        "serve": ("unicon.study.cli", "serve_cli", "the annotation pages (127.0.0.1 by default)"),
        "export": ("unicon.study.cli", "export_cli", "shares, mean ranks, agreement, correlation with MCD/MGG"),
    },
    "bench": {
        "scoring": ("unicon.bench.scoring", "cli", "batched vs naive likelihood scoring (samples/s)"),
        "train": ("unicon.bench.training", "cli", "consistency vs standard update throughput"),
        "pretrain": ("unicon.bench.training", "pretrain_cli", "pretraining examples/s, FLOPs, share of a matmul peak"),
        "chains": ("unicon.bench.chains", "bench_cli", "batched vs one-at-a-time drift chains"),
        "build-cococon": ("data_builders.cococon", "bench_main", "CocoCon builder pairs/s and peak memory"),
        "help": ("unicon.bench.help", "cli", "every command's --help: seconds, modules imported (fresh processes)"),
        "first-batch": ("unicon.bench.first_batch", "cli",
                        "seconds to an evaluation's first batch, as is vs Lightning imported first"),
    },
}


#: (source, regex the start of the message matches): library messages that a user of this project
#: cannot act on. "warning": a Python warning; otherwise the name of the logger that writes it.
LIBRARY_NOISE = (
    # Lightning, on every run on a machine with SLURM's client installed: the project's SLURM jobs
    # (slurm/train.sbatch) start their ranks with srun, and a run outside SLURM needs no srun
    ("warning", r"The `srun` command is available on your system but is not used"),
    # Lightning's ModelCheckpoint: a run writes its config.yaml and lock into its folder before the
    # callback looks at it, and earlier checkpoints there are resumed on purpose or, with
    # overwrite=true, deleted first (unicon.training.run_folder.claim_run_dir refuses any other case)
    ("warning", r"Checkpoint directory .* exists and is not empty"),
    # Lightning 2.6's own call of a torch API deprecated in torch 2.14 (lightning/pytorch/utilities/_pytree.py)
    ("warning", r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # Lightning's advertisements for its cloud services (litlogger, litmodels), once per run
    ("lightning.pytorch.utilities.rank_zero", r"💡 Tip: "),
)


class _NoiseFilter(logging.Filter):
    """Drops the log records of :data:`LIBRARY_NOISE` written by the logger it is attached to."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_libraries() -> None:
    """Hide :data:`LIBRARY_NOISE`: warnings by a ``warnings`` filter, log lines by a filter on their
    logger (made now if the library is not imported yet: nothing is imported here)."""
    for source, pattern in LIBRARY_NOISE:
        if source == "warning":
            warnings.filterwarnings("ignore", message=pattern)
            continue
        logger = logging.getLogger(source)
        if not any(isinstance(f, _NoiseFilter) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_NoiseFilter(pattern))


def _usage(table: dict, prefix: str) -> str:
    lines = [f"usage: {prefix} [--debug] <command> [options]" if prefix == "unicon" else f"usage: {prefix} <command> [options]",
             "", "commands:"]
    for name, entry in table.items():
        desc = entry[2] if isinstance(entry, tuple) else "{" + ",".join(entry) + "}"
        lines.append(f"  {name:<12} {desc}")
    lines += ["", f"Run '{prefix} <command> --help' for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("UNICON_DEBUG"))
    quiet_libraries()
    while argv and argv[0] == "--debug":  # `unicon --debug <command> ...`: tracebacks for every error
        debug, argv = True, argv[1:]
    table, prefix = COMMANDS, "unicon"
    while True:
        if not argv or argv[0] in ("-h", "--help"):
            print(_usage(table, prefix))
            return 0 if argv else 2
        if argv[0] in ("-V", "--version") and table is COMMANDS:
            print(f"unicon {__version__}")
            return 0
        name, argv = argv[0], argv[1:]
        if name not in table:
            print(f"{prefix}: error: unknown command '{name}' (choose from {', '.join(table)})", file=sys.stderr)
            return 2
        entry, prefix = table[name], f"{prefix} {name}"
        if isinstance(entry, tuple):
            break
        table = entry
    try:
        command = getattr(importlib.import_module(entry[0]), entry[1])
        return int(command(argv) or 0)
    except (UserError, ConfigError, FileNotFoundError) as e:
        if debug:
            raise
        msg = str(e) if not isinstance(e, FileNotFoundError) or not e.filename else f"no such file: {e.filename}"
        print(f"unicon: error: {msg}", file=sys.stderr)
        return 2
    except Preempted as e:
        where = f"checkpoint written: {e.checkpoint}" if e.checkpoint else "partial outputs are kept (rerun to resume)"
        print(f"unicon: {e}; {where}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("unicon: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
