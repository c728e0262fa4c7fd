"""The evaluation framework: a suite is a declaration plus ``load`` and ``run``; the command
(``unicon evaluate <suite>``, its ``--shard``/``--merge``, ``unicon evaluate all``), the epoch-end
callback, the W&B names and the report come from here, the same for every suite.

How to add a suite (in-tree: ``evaluation/<name>/suite.py``, listed in
:data:`unicon.evaluation.suites.IN_TREE`; a plugin: any module named by an entry point of the
``unicon.suites`` group)::

    class MySuite(EvalSuite):
        name, help = "mine", "my benchmark"
        config = MyEvalConfig                 # the dataclass of eval.mine: its fields are the flags
        flags = {"data": Flag("my data file", required=True)}  # per-field exceptions (names, defaults)

        def load(self, config, args, root):   # read and check the data: before any model is loaded
            return read_my_file(config.data)

        def run(self, run):                   # the model calls, sharded over ranks; files into run.out
            scores = score(run.model, run.inputs, run.device)
            return Outcome(metrics={"mine/acc": mean(scores)}, summary=f"acc {mean(scores):.3f}")

    register(MySuite())

What a suite gets without writing it:

* the command: the common flags (:func:`~unicon.evaluation.cli_common.add_common_args`), one flag
  per field of ``config`` (:func:`~unicon.evaluation.cli_common.add_config_args`, with ``flags``'
  exceptions), ``--shard I/N``/``--merge`` (``shardable``), the image-sampling flags
  (``draws_images``), the judge models' flags (``judge_tokens``, :meth:`EvalRun.judge_kwargs`); the
  checks of ``--out``, ``--device`` and the count flags before any work; the model (or, in a merge,
  :class:`~unicon.evaluation.cli_common.RecordedModel`); SIGTERM/SIGUSR1 stop it at the next batch
  (:mod:`unicon.evaluation.preemption`);
* the loggers: ``--logger`` (W&B, CSV or none; ``metrics.jsonl`` always), the run's settings, the
  metrics at step 0 with ``<name>/seconds`` (the evaluation's time; a merge: the shards' sum), the
  figures of ``figures`` and the sample table ``<name>/samples`` (the same names as at epoch end:
  one :meth:`EvalSuite.log_media` for both);
* ``unicon evaluate all`` (:meth:`EvalSuite.argv`: the run config's ``eval.<name>`` as flags, the
  data defaulting as at epoch end: :meth:`EvalSuite.default_data`);
* the epoch-end callback (:meth:`unicon.evaluation.callbacks.SuiteCallback.from_config`: every
  ``every_n_epochs`` epochs, every rank runs ``run``, rank 0 logs);
* the report section (``report``, ``title``, ``headline``: :mod:`unicon.evaluation.suites`);
* the scaffolding of a runner: :func:`eval_mode` around the model calls, :func:`write_results` (the
  summary JSON, ``samples.jsonl``, ``table.md``, strict JSON) and :meth:`EvalRun.printed` (what the
  command prints of them).

``run`` sees one :class:`EvalRun` in all three places; ``run.epoch`` is None standalone, where
``run.args`` holds the command's extra flags and ``run.shards`` the shard state
(:class:`~unicon.evaluation.cli_common.ShardState`: a shard records, a merge reads back what the
shards recorded instead of loading judges). Results files go through :mod:`unicon.jsonsafe`.

This module imports no torch: listing the suites and ``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from unicon.evaluation.cli_common import (
    Flag,
    add_common_args,
    add_config_args,
    add_image_generation_args,
    add_judge_args,
    add_shard_args,
    config_argv,
)


@dataclass
class Outcome:
    """What one evaluation gives the framework: the W&B scalars (``<suite>/<key>``), the sample
    table's ``rows`` under ``columns`` (already cut to ``table_rows``; none: no table), what the
    command prints, and the suite's own value for :meth:`EvalSuite.log_media` (``result``)."""

    metrics: dict[str, float]
    rows: list[list] | None = None
    columns: Sequence[str] = ()
    summary: str = ""
    result: Any = None


@dataclass
class EvalRun:
    """One evaluation, standalone or at an epoch end: what :meth:`EvalSuite.run` sees."""

    config: Any  # the suite's eval dataclass, with the command's or the run config's values
    inputs: Any  # what :meth:`EvalSuite.load` returned
    model: Any
    out: Path  # the command's --out, or <run_dir>/eval/<suite>/epoch-<e>
    device: str
    args: argparse.Namespace | None = None  # standalone only: every flag of the command
    shards: Any = None  # standalone only: the ShardState (mode None, "shard" or "merge")
    epoch: int | None = None  # epoch end only (1-based)
    is_writer: bool = True  # writes the suite's files: rank 0 at epoch end, not a shard standalone
    cache: dict = field(default_factory=dict)  # kept across epoch ends (judges, embedders)
    fingerprint: str | None = None  # the weights' (standalone)

    @property
    def merging(self) -> bool:
        """A ``--merge``: the model is a stand-in, and judges are not loaded (the shards' records hold
        their results)."""
        return self.shards is not None and self.shards.mode == "merge"

    @property
    def standalone(self) -> bool:
        return self.epoch is None

    def record(self, name: str, value: Any) -> Any:
        """``value``, recorded by a shard and read back by the merge (standalone); ``value`` at epoch end."""
        return value if self.shards is None else self.shards.record(name, value)

    def image_config(self):
        """The image-sampling settings of a standalone run: the model's own with the command's flags
        over them; None at epoch end (the runners then use the model's own)."""
        if self.args is None:
            return None
        from unicon.evaluation.cli_common import image_generation_config

        return image_generation_config(self.model, self.args)

    def printed(self, summary_file: str, middle: str = "") -> str:
        """What the command prints once the suite wrote :func:`write_results`' files: ``table.md``,
        ``middle``, then the files' names; nothing at epoch end or in a shard."""
        if not (self.standalone and self.is_writer):
            return ""
        return (self.out / "table.md").read_text() + middle + \
            f"wrote {self.out / summary_file} and {self.out / 'samples.jsonl'}"

    def judge_kwargs(self) -> dict[str, Any]:
        """How a standalone run loads its judge models (:attr:`EvalSuite.judge_tokens`): the device and the
        judge flags; ``{}`` at epoch end."""
        args = self.args
        if args is None:
            return {}
        return {"device": args.device, "dtype": args.judge_dtype, "trust_remote_code": args.trust_remote_code,
                "max_new_tokens": args.judge_max_new_tokens}

    def judge_settings(self, **judges: Any) -> dict[str, Any]:
        """``judges`` (their specs) with the judge flags a standalone run records."""
        return {**judges, "dtype": self.args.judge_dtype, "max_new_tokens": self.args.judge_max_new_tokens}

    def checkpoint_info(self) -> dict[str, Any]:
        """``ckpt``, ``checkpoint`` (resolved) and ``model_fingerprint`` of a standalone run."""
        return {"ckpt": str(self.args.ckpt), "checkpoint": str(Path(self.args.ckpt).resolve()),
                "model_fingerprint": self.fingerprint}


class EvalSuite:
    """The declaration of one evaluation suite (see the module docstring). Class attributes declare it;
    :meth:`load` and :meth:`run` evaluate; the other methods have defaults a suite may override."""

    name: str = ""
    help: str = ""  # one line in `unicon evaluate --help`
    description: str = ""  # the command's --help description
    config: type | None = None  # the dataclass of eval.<name> (its fields: the flags)
    flags: Mapping[str, Flag] = {}
    skip: Sequence[str] = ()  # config fields without a flag
    out_help: str = "output folder"
    shardable: bool = True  # takes --shard I/N and --merge
    draws_images: bool = True  # takes the image-sampling flags
    judge_tokens: int | None = None  # loads judge models: takes the judge flags, this the default reply budget
    counts: Sequence[str] = ()  # extra integer flags that must be >= 1
    figures: str | None = None  # "module:NAMES" of the figure files logged as <name>/fig/<file>
    report: str | None = None  # "module:function" rendering its report.html section
    title: str | None = None
    headline: Sequence[str] = ()  # metrics of the report's summary table and curves

    @property
    def section(self) -> str:
        """Its part of the run config, ``eval.<section>``."""
        return self.name

    # -- to implement ---------------------------------------------------------------------------------
    def load(self, config, args: argparse.Namespace | None, root: str | None) -> Any:
        """Read and check the data (and every setting that can be checked without a model): before a
        model is loaded, and at epoch end before training starts. ``args``: the command's flags
        (None at epoch end); ``root``: the run's ``data.root`` (None standalone)."""
        raise NotImplementedError

    def run(self, run: EvalRun) -> Outcome:
        raise NotImplementedError

    # -- may override ---------------------------------------------------------------------------------
    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """The command's flags that are no field of ``config`` (judges' dtypes, ...)."""

    def default_data(self, run_cfg) -> str:
        """``eval.<name>.data`` when unset: the run's ``data.root``."""
        return str(run_cfg.data.root)

    def check_model(self, model, inputs, config) -> None:
        """Refuse a model the suite cannot evaluate, before training starts (epoch end)."""

    def log_media(self, loggers, outcome: Outcome, out: Path, step: int) -> None:
        """The figures and the sample table, standalone and at epoch end (rank 0 only)."""
        from unicon.evaluation.logs import log_figures, log_table

        if outcome.rows is not None:
            log_table(loggers, f"{self.name}/samples", list(outcome.columns), outcome.rows, step=step)
        if self.figures is not None:
            log_figures(loggers, self.name, out, _attribute(self.figures), step=step)

    # -- provided -------------------------------------------------------------------------------------
    def section_values(self, run_cfg) -> dict[str, Any]:
        """``eval.<name>`` of a composed run config, as plain values, the data defaulted."""
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(run_cfg.eval[self.section], resolve=True)
        if "data" in values and not values["data"]:
            values["data"] = self.default_data(run_cfg)
        return values

    def config_of(self, run_cfg):
        """The eval dataclass of a composed run config (epoch end)."""
        return self.config(**self.section_values(run_cfg))

    def argv(self, run_cfg) -> list[str]:
        """The run config's ``eval.<name>`` as this command's flags (``unicon evaluate all``)."""
        return config_argv(self.section_values(run_cfg), self.config, self.flags, self.skip)

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"unicon evaluate {self.name}", description=self.description or self.help)
        add_common_args(p, out_help=self.out_help)
        add_config_args(p, self.config, self.flags, self.skip)
        self.add_arguments(p)
        if self.judge_tokens is not None:
            add_judge_args(p, self.judge_tokens)
        if self.draws_images:
            add_image_generation_args(p)
        if self.shardable:
            add_shard_args(p)
        return p

    def cli(self, argv: Sequence[str] | None = None) -> int:
        """``unicon evaluate <name> ...``."""
        return run_command(self, argv)

    def report_section(self):
        """The report section renderer ``(run_dir) -> HTML`` (imported now), None without one."""
        return None if self.report is None else _attribute(self.report)

    def report_module(self):
        """The module of the report section renderer (imported now), None without one: its optional
        ``headline_table``, ``compare``, ... (:mod:`unicon.evaluation.suites`)."""
        return None if self.report is None else importlib.import_module(self.report.split(":")[0])


def _attribute(spec: str):
    """``"module:name"`` -> the object (its module imported now)."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def write_jsonl(path: Path, records) -> None:
    """One strict-JSON line per record (:mod:`unicon.jsonsafe`: non-finite numbers as null; non-ASCII kept)."""
    from unicon import jsonsafe

    with open(path, "w") as f:
        for rec in records:
            f.write(jsonsafe.dumps(rec, ensure_ascii=False) + "\n")


def write_results(out: Path, summary_file: str, summary: dict, records=None, table: str | None = None) -> None:
    """The files of a suite's evaluation in ``out``, strict JSON (:mod:`unicon.jsonsafe`): ``samples.jsonl``
    (:func:`write_jsonl`, when ``records`` are given), ``summary_file`` (indented; other values as text)
    and ``table.md`` (when ``table`` is given)."""
    from unicon import jsonsafe

    if records is not None:
        write_jsonl(out / "samples.jsonl", records)
    (out / summary_file).write_text(jsonsafe.dumps(summary, indent=2, default=str) + "\n")
    if table is not None:
        (out / "table.md").write_text(table)


def write_images(out: Path, images: Mapping[str, Any], key: str) -> dict[str, str | None]:
    """Each image of ``images`` (``{name: PIL image or None}``) as ``images/<name>/<key>.png`` under ``out``;
    ``{name: its path relative to out, or None where there is no image}``."""
    paths: dict[str, str | None] = {}
    for name, im in images.items():
        paths[name] = None if im is None else str(Path("images") / name / f"{key}.png")
        if im is not None:
            (out / paths[name]).parent.mkdir(parents=True, exist_ok=True)
            im.save(out / paths[name])
    return paths


@contextmanager
def eval_mode(model):
    """The block runs ``model`` in eval mode under ``torch.no_grad``; its training mode is restored after."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def run_command(suite: EvalSuite, argv: Sequence[str] | None) -> int:
    """The standalone command of ``suite``: parse, check, load the data, then the model (a merge: the
    shards' record), run, and log (see the module docstring)."""
    args = suite.parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    import time

    from unicon.config import LoggerConfig
    from unicon.evaluation import preemption
    from unicon.evaluation.cli_common import check_common_args, config_from_args, load_model_for, sharding
    from unicon.evaluation.logs import log_eval_config, log_metrics
    from unicon.loggers import make_loggers

    config = config_from_args(args, suite.config, suite.flags, suite.skip)
    counts = suite.counts if suite.judge_tokens is None else (*suite.counts, "judge_max_new_tokens")
    out = check_common_args(args, counts)
    inputs = suite.load(config, args, None)
    with sharding(args, out) as shards, preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch
        model, fingerprint = shards.load_model(args, load_model_for)  # a merge: recorded, no weights
        run = EvalRun(config, inputs, model, out, str(args.device), args=args, shards=shards,
                      is_writer=shards.mode != "shard", fingerprint=fingerprint)
        start = time.perf_counter()
        outcome = suite.run(run)
        seconds = shards.extra["run_seconds"] = time.perf_counter() - start
    if shards.mode == "merge":  # the evaluation's time is the shards'
        seconds = sum(info["extra"]["run_seconds"] for info in shards.done)
    if shards.mode == "shard":
        print(f"{suite.name}: shard {args.shard} done; merge with --merge once every shard is done")
        return 0
    # --logger none: no W&B or CSV run, but metrics.jsonl
    loggers = make_loggers(LoggerConfig(type=args.logger, tags=[suite.name]), out,
                           name=args.name or f"{suite.name}-{out.name}", replace=True)
    log_eval_config(loggers, args, fingerprint)
    log_metrics(loggers, {**outcome.metrics, f"{suite.name}/seconds": seconds}, step=0)
    suite.log_media(loggers, outcome, out, step=0)
    for lg in loggers:
        lg.finalize("success")
    if outcome.summary:
        print(outcome.summary)
    return 0

