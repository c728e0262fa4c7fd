"""``unicon train``: compose the config, build model + data, fit with Lightning, export.

``train(cfg)`` is the whole run:

1. claim the run folder ``<output_dir>/<name>/`` (a lock file; a folder that already holds a run
   is refused unless this run resumes it or ``overwrite=true`` deletes it), seed everything
   (``cfg.seed``) and write the resolved ``config.yaml`` there (the same config goes into every
   checkpoint);
2. build the model, or load it from ``resume`` / ``init_from`` (a ``model:`` section that
   describes another network than that checkpoint is refused), and turn on gradient checkpointing
   and LoRA if asked: one call, ``unicon.models.checkpoints.load_for_training``;
3. wrap it in :class:`~unicon.training.module.ConsistencyModule` (Algorithm 1) with the
   :class:`~unicon.training.datamodule.ConsistencyDataModule`;
4. ``Trainer.fit`` with the strategy of ``trainer.strategy`` (``auto``, ``ddp``, ``fsdp``,
   ``deepspeed_zero2[_offload]``, ``deepspeed_zero3[_offload]`` -- the DeepSpeed ones read
   ``configs/strategy/<name>.json``), ModelCheckpoint in the run directory, Lightning's
   LearningRateMonitor (``train/lr/decay``, ``train/lr/no_decay``), a rich progress bar,
   the loggers of ``unicon.loggers.make_loggers`` (the W&B run id kept in
   ``<run_dir>/wandb_run_id``; the flattened config, git commit, package versions and weights
   fingerprint as the W&B config) and the enabled epoch-end evaluations;
   ``resume=<ckpt>`` restores optimizer, scheduler, step, the γ generator and the data order, and
   continues the same W&B run;
5. export the final model with ``save_pretrained`` to ``<run_dir>/export`` (LoRA merged; a
   DeepSpeed run's export is converted from its last checkpoint folder, ZeRO-2 and ZeRO-3 alike:
   :func:`export_deepspeed_run`).

``unicon train resume=CKPT [overrides]`` (:func:`compose_run`) is the same run: its config is the
one stored in ``CKPT``, with the command-line overrides on top, each change printed.
Checkpoints load with ``weights_only=True``; unpickling needs ``model.allow_pickle=true``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from omegaconf import OmegaConf

from unicon.config import GROUPS, ConfigError, compose, compose_resume, config_dir, to_yaml
from unicon.data.jsonl import read_json
from unicon.errors import UserError
from unicon.evaluation.preemption import Preempted
from unicon.evaluation.suites import suites
from unicon.report import collect, headline_table, write_report

EXAMPLES = """\
examples:
  unicon train experiment=shapes_demo
  unicon train experiment=shapes_consistency loss=hinge seed=1
  unicon train experiment=shapes_consistency_control trainer.max_steps=200
  unicon train loss.lambda_=0.5 loss.gamma=0.5 optim.lr=1e-5 trainer.max_epochs=3
  unicon train model.lora.enabled=true model.lora.r=16 trainer=gpu trainer.precision=bf16-mixed
  unicon train trainer=gpu trainer.devices=4 trainer.strategy=deepspeed_zero2
  unicon train resume=checkpoints/run/last.ckpt trainer.max_epochs=4

precedence (later wins): schema defaults < group files (config.yaml defaults < experiment defaults
< group=name on the command line) < config.yaml body < experiment body < group files chosen on the
command line < key=value overrides. An experiment file with `extends: <experiment>` comes after its
parent's defaults and body. With resume=CKPT: the config stored in CKPT < command line.

main keys:
  name, seed, output_dir (run dir = <output_dir>/<name>), init_from, resume, resume_older, overwrite
  loss.type (spearman|hinge|none)  loss.lambda_  loss.gamma  loss.regularization_strength
  loss.tasks  loss.on_nonfinite (stop|skip)  optim.lr  optim.warmup_ratio  optim.scheduler
  trainer.max_epochs  trainer.max_steps  trainer.devices  trainer.strategy  trainer.precision
  trainer.accumulate_grad_batches  data.root  data.batch_size  data.contrast_batch_size
  data.max_contrast  data.num_workers  model.gradient_checkpointing  model.lora.*
"""


def _available() -> str:
    root = config_dir()
    lines = ["config groups (group=name):"]
    for group in (*GROUPS, "experiment"):
        names = sorted(p.stem for p in (root / group).glob("*.yaml"))
        lines.append(f"  {group:<11} {', '.join(names) or '-'}")
    jsons = sorted(p.stem for p in (root / "strategy").glob("*.json"))
    lines.append(f"  trainer.strategy: auto, ddp, fsdp{', ' + ', '.join(jsons) if jsons else ''}")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="unicon train",
        description="Consistency training (CocoCon Algorithm 1) of a unified model with Lightning. "
        "Positional arguments are config overrides: group=name picks configs/<group>/<name>.yaml, "
        "experiment=name applies configs/experiment/<name>.yaml, key.sub=value sets one key.",
        epilog=_available() + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="group=name and key=value overrides")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    try:
        cfg = compose_run(args.overrides, announce=not args.print_config)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    result = train(cfg)
    report = write_report(result["run_dir"])
    table = headline_table(collect(Path(result["run_dir"])))
    if table:
        print(table)
    print(f"checkpoint: {result['ckpt_path']}")
    print(f"export:     {result['export_dir']}")
    print(f"W&B run:    {result['wandb_dir'] or '(no W&B logger)'}")
    print(f"report:     {report}  (metrics: {result['run_dir']}/metrics.jsonl)")
    return 0


def compose_run(overrides: list[str], announce: bool = True):
    """The config of ``unicon train OVERRIDES``. With ``resume=CKPT`` it is the config stored in
    CKPT with the other overrides applied on top (each change printed when ``announce``).

    In a requeued SLURM job (``SLURM_RESTART_COUNT`` > 0) the command line is the one of the first
    start, so it says nothing about where the run got to: the run resumes from the newest
    checkpoint of its run folder (:func:`requeue_checkpoint`), exactly as with ``resume=``."""
    restarts = slurm_restart_count()
    if restarts:
        ckpt = requeue_checkpoint(overrides)
        if ckpt is not None:
            if announce:
                print(f"SLURM job {os.environ.get('SLURM_JOB_ID', '?')} restarted ({restarts}x): resuming from {ckpt}")
            overrides = [o for o in overrides if not o.startswith("resume=")] + [f"resume={ckpt}"]
    return _compose(overrides, announce)


def _compose(overrides: list[str], announce: bool):
    # lazy: pulls in every model backend (transformers), not needed by unicon train --help
    from unicon.models.checkpoints import read_training_checkpoint

    resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if not resume or not resume[-1] or resume[-1] in ("null", "None"):
        return compose(overrides)
    path = resume[-1]
    rest = [o for o in overrides if not o.startswith("resume=")]
    pickle_opt = [o.split("=", 1)[1] for o in rest if o.startswith("model.allow_pickle=")]
    allow_pickle = bool(pickle_opt) and pickle_opt[-1].strip().lower() in ("true", "1", "yes")
    ckpt = read_training_checkpoint(path, allow_pickle=allow_pickle, mmap=True)
    cfg, changes = compose_resume(ckpt["unicon_config"], f"{path} (stored config)", rest, resume=path)
    if announce:
        print(f"resume: {path} (run '{cfg.name}', step {ckpt.get('global_step', '?')}), with the config stored in it")
        for change in changes:
            print(f"resume: command line changes {change}")
    return cfg


# ---- SLURM preemption and requeue ---------------------------------------------------------------
HPC_PREFIX = "hpc_ckpt_"  # Lightning's name for requeue checkpoints (``ckpt_path="hpc"`` finds them)


def slurm_restart_count() -> int:
    """How often SLURM has requeued this job (``SLURM_RESTART_COUNT``, set in the batch script's and
    the job steps' environment from the first requeue on); 0 outside SLURM and on the first start."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def requeue_checkpoint(overrides: list[str]) -> Path | None:
    """The checkpoint a requeued run continues from: of ``<run_dir>/hpc_ckpt_*.ckpt`` (written at
    SIGUSR1), ``<run_dir>/last.ckpt`` (periodic; the only one after a requeue without warning, e.g.
    a node failure), the run folder's other ``*.ckpt`` (ModelCheckpoint's) and an explicit
    ``resume=`` of the command line, the one with the highest ``global_step``. Files and DeepSpeed
    checkpoint folders alike. None when there is none (the job was requeued before its first
    checkpoint). Unreadable candidates (a save cut by a kill; a DeepSpeed folder without its
    ``complete.json``) are skipped with a message."""
    # lazy: pulls in every model backend (transformers), not needed by unicon train --help
    from unicon.models.checkpoints import is_deepspeed_checkpoint, read_training_checkpoint

    cfg = _compose(overrides, announce=False)  # with resume=: the run folder of the stored config
    candidates = folder_checkpoints(_run_dir(cfg))
    if cfg.resume:
        candidates.append(Path(cfg.resume))
    best, best_step = None, -1
    for path in candidates:
        if not (path.is_file() or is_deepspeed_checkpoint(path)):
            continue
        try:
            step = int(read_training_checkpoint(path, allow_pickle=bool(cfg.model.allow_pickle), mmap=True)
                       .get("global_step", -1))
        except UserError as e:
            print(f"SLURM restart: skipping {path}: {e}")
            continue
        if step > best_step:  # ties: the earlier candidate (hpc, then last, then resume=): same state
            best, best_step = path, step
    return best


def folder_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints of a run folder (files and DeepSpeed checkpoint folders): ``hpc_ckpt_*.ckpt``,
    ``last.ckpt``, then ModelCheckpoint's others; the order in which :func:`requeue_checkpoint`
    prefers one of equal steps (they hold the same state)."""
    from unicon.models.checkpoints import is_deepspeed_checkpoint  # lazy: pulls in every model backend

    others = sorted(p for p in folder.glob("*.ckpt") if p.name != "last.ckpt" and not p.name.startswith(HPC_PREFIX))
    candidates = sorted(folder.glob(f"{HPC_PREFIX}*.ckpt")) + [folder / "last.ckpt"] + others
    return [p for p in candidates if p.is_file() or is_deepspeed_checkpoint(p)]


def check_resume_is_newest(cfg: DictConfig, step: int) -> None:
    """Refuse ``resume=`` of a checkpoint (at global ``step``) while another checkpoint in its folder
    holds a later step, naming both, unless ``resume_older=true``: resuming it would go back and
    redo (and overwrite) the later steps. Checkpoints that cannot be read (a save cut short, a
    DeepSpeed folder without its ``complete.json``) do not count."""
    from unicon.models.checkpoints import read_training_checkpoint  # lazy: pulls in every model backend

    if cfg.resume_older:
        return
    resume = Path(cfg.resume)
    newest, newest_step = None, step
    for path in folder_checkpoints(resume.parent):
        if path.resolve() == resume.resolve():
            continue
        try:
            other = int(read_training_checkpoint(path, allow_pickle=bool(cfg.model.allow_pickle), mmap=True)
                        .get("global_step", -1))
        except UserError:
            continue
        if other > newest_step:
            newest, newest_step = path, other
    if newest is not None:
        last = last_training_row(resume.parent / "metrics.jsonl")
        logged = "" if last is None else (
            f" (metrics.jsonl's last training row is step {last}: resuming {newest.name} continues after step "
            f"{newest_step - 1}, resume_older=true trains again from step {step} and rewrites the rows after it)")
        raise UserError(f"resume={resume} is at step {step}, but {newest} in the same folder is at step {newest_step}: "
                        f"resume from {newest}, or pass resume_older=true to go back to step {step}{logged}")


def last_training_row(metrics: Path) -> int | None:
    """The step of the last ``train/loss`` row of a run's ``metrics.jsonl`` (None: no file or no such
    row). A line cut short by a kill is passed over. A checkpoint saved at the end of step ``s`` comes
    before the row of step ``s`` is written, so a kill between the two leaves the newest checkpoint
    one row ahead of the file, which the refusal above shows."""
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "train/loss" in row and isinstance(row.get("step"), int):
            last = row["step"]
    return last


def next_hpc_checkpoint(run_dir: Path) -> Path:
    numbers = [int(p.stem[len(HPC_PREFIX):]) for p in run_dir.glob(f"{HPC_PREFIX}*.ckpt")
               if p.stem[len(HPC_PREFIX):].isdigit()]
    return run_dir / f"{HPC_PREFIX}{max(numbers, default=0) + 1}.ckpt"


class SlurmRequeue:
    """Checkpoint-and-requeue on SLURM's warning signal (``#SBATCH --signal=SIGUSR1@90``).

    Lightning's own handler (``SLURMEnvironment(auto_requeue=True)``) saves the checkpoint inside
    the signal handler, i.e. wherever the main thread is when the signal lands: ranks then enter
    the checkpoint's barriers at different points of their step (against DDP's gradient
    all-reduce: a hang or a mismatched collective), and a checkpoint taken between fetching a batch
    and finishing it resumes with the data position and γ generator of a half-done step. Here the
    handler only sets a flag, and the step boundary does the work:

    * ``on_train_batch_end`` (where ``ModelCheckpoint`` saves, a tested exact-resume point): the
      ranks agree whether any of them got the signal (one-element all-reduce per step) and all save
      ``<run_dir>/hpc_ckpt_<n>.ckpt`` at the same step;
    * the next hook (``on_train_batch_start``, ``on_train_epoch_end``) comes after Lightning wrote
      that step's metrics row, which the checkpoint's log offsets then keep: it raises
      :class:`~unicon.evaluation.preemption.Preempted`, so the run stops without an export;
    * :meth:`requeue`, called by :func:`train` once the Trainer has torn down (loggers flushed, the
      W&B run closed), runs ``scontrol requeue`` on global rank 0; the other ranks exit 0, so that
      ``srun --kill-on-bad-exit=1`` does not end the step first. SLURM then kills the job's
      processes, which have nothing left to write, and starts the job again; :func:`compose_run`
      resumes it from the newest checkpoint, continuing ``metrics.jsonl`` and the W&B run.

    A signal during an epoch-end evaluation also reaches :mod:`unicon.evaluation.preemption`, whose
    callback writes ``last.ckpt`` and raises ``Preempted``; :meth:`requeue` requeues that as well.
    """

    signum = signal.SIGUSR1

    def __init__(self, run_dir: Path):
        from lightning.pytorch.callbacks import Callback

        self.run_dir = Path(run_dir)
        self.signalled = False
        self.checkpoint: Path | None = None
        self._previous = None
        outer = self

        class _Hooks(Callback):  # the Lightning callback; SlurmRequeue itself also owns the handler
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                outer._on_step_end(trainer)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                outer._stop_if_saved()

            def on_train_epoch_end(self, trainer, pl_module):
                outer._stop_if_saved()

        self.callback = _Hooks()

    def install(self) -> None:
        """SIGUSR1 sets the flag from now on (its default action would kill the process). Call
        before the model is built: the warning can come while a large model loads."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handler)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def _handler(self, signum, frame) -> None:
        self.signalled = True

    def _on_step_end(self, trainer) -> None:
        if self.checkpoint is not None or not trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            return
        loop = trainer.fit_loop
        if (0 <= trainer.max_steps <= trainer.global_step) or (
                loop.epoch_loop.batch_progress.is_last_batch and loop.max_epochs is not None
                and 0 <= loop.max_epochs <= trainer.current_epoch + 1):
            return  # the run ends after this step anyway: finishing beats a requeue
        path = Path(trainer.strategy.broadcast(str(next_hpc_checkpoint(self.run_dir))))
        trainer.save_checkpoint(path)  # collective: every rank, at the same step
        self.signalled = True  # ranks that did not get the signal themselves requeue too
        self.checkpoint = path

    def _stop_if_saved(self) -> None:
        if self.checkpoint is not None:
            raise Preempted(self.signum, checkpoint=str(self.checkpoint))

    def requeue(self, is_global_zero: bool) -> None:
        """``scontrol requeue`` this job if the warning signal came (rank 0 only); the last thing
        a preempted run does. A job that cannot be requeued (``--no-requeue``, outside SLURM) keeps
        its checkpoint: the message says how to resume by hand."""
        if not (self.signalled and is_global_zero):
            return
        array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        job = f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")
        hint = f"resume with resume={self.checkpoint or self.run_dir / 'last.ckpt'}"
        if not job:
            print(f"SIGUSR1 outside a SLURM job: not requeued; {hint}")
            return
        # said before the call: SLURM kills the job as soon as the requeue is accepted, often before
        # a message printed afterwards reaches the log
        print(f"requeueing SLURM job {job}; it resumes from {self.checkpoint or 'the newest checkpoint'}", flush=True)
        try:
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            ok, why = proc.returncode == 0, (proc.stderr or proc.stdout).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, why = False, str(e)
        if not ok:
            print(f"scontrol requeue {job} failed ({why}); {hint}", flush=True)


# ---- pieces of train() ------------------------------------------------------------------------
def deepspeed_config(name: str, micro_batch_size: int) -> dict:
    """``configs/strategy/<name>.json`` with ``train_micro_batch_size_per_gpu`` set to
    ``micro_batch_size`` (``data.batch_size``: the mixture rows one rank's step takes; DeepSpeed
    uses it for ``train_batch_size = micro x accumulation x ranks`` and its throughput logs). The
    key belongs to the data config, so a strategy file that sets it is refused."""
    path = config_dir() / "strategy" / f"{name}.json"
    if not path.is_file():
        raise UserError(f"no DeepSpeed config {path}")
    config = read_json(path, what="DeepSpeed config")
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    if "train_micro_batch_size_per_gpu" in config:
        raise UserError(f"{path}: train_micro_batch_size_per_gpu comes from data.batch_size; remove the key "
                        f"(it is {config['train_micro_batch_size_per_gpu']!r} there)")
    config["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    return config


def keeps_running_statistics(model: torch.nn.Module) -> bool:
    """Whether ``model`` has buffers that training updates (BatchNorm running statistics), which DDP
    keeps equal across ranks by broadcasting rank 0's before every forward. Conservative: a BatchNorm
    held on its statistics by ``model.freeze_batchnorm`` still counts."""
    import torch

    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
               for m in model.modules())


def check_strategy(name: str, micro_batch_size: int = 1) -> dict | None:
    """Refuse, before any work, a ``trainer.strategy`` this machine cannot run: DeepSpeed needs the
    ``deepspeed`` package, a valid ``configs/strategy/<name>.json`` and, to offload the optimizer,
    its CPU Adam op. Returns that DeepSpeed config (None otherwise). (DeepSpeed runs on GPUs and,
    with ``trainer.accelerator=cpu``, on CPU: :mod:`unicon.training.zero`.)"""
    if not name.startswith("deepspeed"):
        return None
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise UserError(f"trainer.strategy={name} needs deepspeed ({e}); "
                        "pip install -c constraints.txt -e '.[deepspeed]'") from None
    config = deepspeed_config(name, micro_batch_size)
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device", "none") in ("cpu", "nvme") and (why := cpu_adam_unavailable()):
        raise UserError(f"trainer.strategy={name} offloads the optimizer to DeepSpeed's CPU Adam, but {why}")
    return config


def cpu_adam_unavailable() -> str | None:
    """None when DeepSpeed's CPU Adam op loads without compiling (built at install with
    ``DS_BUILD_CPU_ADAM=1``, or by ``make test`` into torch's extension cache); otherwise why not."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory

    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's CPUAdamBuilder is not compatible with this machine"
    if installed_ops.get("cpu_adam") or any(Path(_get_build_directory(builder.name, False)).glob("*.so")):
        return None
    return ("its C++ op is not built; build it once with `python scripts/build_deepspeed_ops.py` "
            "(make test does), or install deepspeed with DS_BUILD_CPU_ADAM=1")


def make_strategy(name: str, micro_batch_size: int = 1, broadcast_buffers: bool = True):
    """Lightning strategy object/name for ``trainer.strategy`` (one of ``unicon.config.STRATEGIES``,
    checked at compose time), after :func:`check_strategy`. ``micro_batch_size``:
    ``data.batch_size`` (DeepSpeed's ``train_micro_batch_size_per_gpu``, :func:`deepspeed_config`).
    ``broadcast_buffers`` (DDP): False for a model whose buffers are constants of its config
    (:func:`keeps_running_statistics` is False): OFA's relative-position bucket tables are 33 MB in
    ``shapes-tiny``, and broadcasting them before every forward cost 13% of a step of the two-rank
    CPU recipe (0.39 s against 0.33-0.34 s).

    DDP searches every step's autograd graph for unused parameters (``find_unused_parameters``): a
    step uses a task-dependent subset of them (OFA's image-code decoder embeddings only in T2I, its
    image stem only with image inputs) and ranks mix tasks differently. The search costs about 1 ms
    of a 340 ms step of the ShapesWorld recipe (2,100 graph nodes); ``static_graph`` would assume one
    set of used parameters for every step, which mixed-task batches break."""
    config = check_strategy(name, micro_batch_size)
    if config is not None:
        from unicon.training.zero import ZeroStrategy  # lazy: pulls in Lightning's DeepSpeed strategy

        return ZeroStrategy(config=config)
    if name in ("ddp", "ddp_spawn"):
        import inspect

        from lightning.pytorch.strategies import DDPStrategy
        from torch.nn.parallel import DistributedDataParallel

        # torch 2.13 renamed DDP's broadcast_buffers (deprecated) to forward_sync_buffers
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
            DistributedDataParallel).parameters else "broadcast_buffers"
        return DDPStrategy(find_unused_parameters=True, start_method="spawn" if name == "ddp_spawn" else "popen",
                           **{sync: broadcast_buffers})
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(sharding_strategy="FULL_SHARD")
    return name


def build_training_model(cfg: DictConfig):
    """The UnifiedModel a run starts from, with the config's model options (dtype, freezing),
    gradient checkpointing and LoRA applied (:func:`unicon.models.checkpoints.load_for_training`)."""
    # lazy: pulls in every model backend (transformers), not needed by unicon train --help
    from unicon.models.checkpoints import load_for_training

    return load_for_training(cfg)


def make_eval_callbacks(cfg: DictConfig) -> list:
    """Epoch-end evaluation callbacks of the enabled suites. A suite that cannot be built fails the
    run here, before training starts (never silently skipped). A plugin suite's section is in every
    composed config (:func:`unicon.config.set_eval_sections`), so its callback is built like an in-tree one."""
    callbacks = []
    for s in suites().values():  # the suite registry names each suite's eval.<section> and callback
        if s.section is None or s.callback is None or not cfg.eval[s.section].enabled:
            continue
        callbacks.append(_make_callback(s.section, s.callback_class(), cfg))
    return callbacks


def _make_callback(suite: str, cls, cfg: DictConfig):
    """Each suite's constructor: ``from_config(RunConfig)`` where it has one, else ``(section, world_root)``."""
    if hasattr(cls, "from_config"):
        return cls.from_config(cfg)
    return cls(cfg.eval[suite], world_root=cfg.data.root, fail_on_error=cfg.eval.fail_on_error)


def _run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / cfg.name


LOCK_NAME = ".lock"


def _holds_no_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds no checkpoint (no ``*.ckpt`` file or DeepSpeed checkpoint folder, at
    any depth) and no ``export/``: in a run folder, what a run leaves that failed before its first
    checkpoint, with nothing to resume or keep."""
    return not (run_dir / "export").exists() and next(run_dir.rglob("*.ckpt"), None) is None


def claim_run_dir(cfg: DictConfig):
    """Create and lock the run folder; returns the open lock file (held until the process ends or
    :func:`release_run_dir`). Under DDP only global rank 0 claims it.

    A folder that already holds files is refused unless the run resumes a checkpoint inside it
    (a requeued SLURM job does: :func:`compose_run`) or ``overwrite=true`` (which deletes the old
    run's files first). A run folder (one with a lock file) that holds nothing to resume or keep
    (:func:`_holds_no_checkpoint`: a run that stopped before its first checkpoint) is cleared and reused.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    run_dir = _run_dir(cfg)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run folder {run_dir} (output_dir/name) exists and is not a directory")
    if rank_zero_only.rank != 0:
        return None
    was_run = (run_dir / LOCK_NAME).is_file()  # claimed by an earlier run, not just any folder
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / LOCK_NAME, "a+")
    except OSError as e:
        raise UserError(f"cannot create the run folder {run_dir} ({e.strerror}); check output_dir") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "?"
        lock.close()
        raise UserError(f"{run_dir} is in use by another unicon run (pid {owner}); choose another name=") from None
    entries = sorted(p for p in run_dir.iterdir() if p.name != LOCK_NAME)
    resuming = bool(cfg.resume) and Path(cfg.resume).resolve().parent == run_dir.resolve()
    if entries and not resuming:
        if was_run and _holds_no_checkpoint(run_dir):
            print(f"{run_dir}: clearing the files of a run that stopped before its first checkpoint")
        elif not cfg.overwrite:
            lock.close()
            raise UserError(f"{run_dir} already holds a run ({len(entries)} entries, e.g. {entries[0].name}); resume it "
                            f"with resume={run_dir / 'last.ckpt'}, choose another name=, or pass overwrite=true "
                            "to delete it")
        for p in entries:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def write_run_config(run_dir: Path, cfg: DictConfig) -> None:
    """Write the resolved ``config.yaml`` into the run folder, on global rank 0 only: only rank 0
    creates the folder (:func:`claim_run_dir`), so another rank could get there first and find none."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))


def release_run_dir(lock) -> None:
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def train(cfg: DictConfig, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Run one training job; returns ``{run_dir, ckpt_path, export_dir, wandb_dir, metrics}``."""
    import torch  # here, not at the top: unicon train --help needs no torch

    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.accelerator={cfg.trainer.accelerator} needs CUDA, but torch.cuda.is_available() is "
                        "False on this machine; use trainer=cpu")
    check_strategy(cfg.trainer.strategy, cfg.data.batch_size)  # fail early (DeepSpeed without CUDA)
    if cfg.resume:
        # lazy: pulls in every model backend (transformers), not needed by unicon train --help
        from unicon.models.checkpoints import read_training_checkpoint

        state = read_training_checkpoint(cfg.resume, allow_pickle=cfg.model.allow_pickle, mmap=True)  # readable, ours
        check_resume_is_newest(cfg, int(state.get("global_step", -1)))
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    requeue = SlurmRequeue(_run_dir(cfg)) if SLURMEnvironment.detect() else None
    if requeue is not None:
        requeue.install()
    try:
        lock = claim_run_dir(cfg)
        try:
            return _train(cfg, extra_callbacks, requeue)
        finally:
            release_run_dir(lock)
    except Preempted:
        if requeue is not None:
            requeue.requeue(is_global_zero=rank_zero_only.rank == 0)
            if requeue.signalled and rank_zero_only.rank != 0:
                # rank 0 requeues the job: this rank's part is done, and a failing exit would make
                # srun --kill-on-bad-exit=1 (slurm/train.sbatch) end the step before rank 0 gets there
                raise SystemExit(0) from None
        raise
    finally:
        if requeue is not None:
            requeue.uninstall()


def _train(cfg: DictConfig, extra_callbacks: list | None, requeue: SlurmRequeue | None = None) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar

    from unicon.data.coco_mixture import image_resize_for

    from unicon.models.checkpoints import export_model  # lazy: pulls in every model backend (transformers)
    from unicon.training.datamodule import ConsistencyDataModule  # lazy: pulls in Lightning
    from unicon.loggers import log_run_artifacts, log_run_config, make_loggers, wandb_run_dir  # not for --help
    from unicon.training.log_files import LogFilesCallback  # lazy: pulls in Lightning
    from unicon.training.module import ConsistencyModule  # lazy: pulls in Lightning

    tcfg = cfg.trainer
    run_dir = _run_dir(cfg)
    eval_callbacks = make_eval_callbacks(cfg)  # a suite that cannot be built fails before any work
    if tcfg.cpu_threads:
        torch.set_num_threads(int(tcfg.cpu_threads))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    model = build_training_model(cfg)
    # built with the model: it decides whether DDP broadcasts buffers before every forward
    strategy = make_strategy(cfg.trainer.strategy, cfg.data.batch_size,
                             broadcast_buffers=keeps_running_statistics(model))
    write_run_config(run_dir, cfg)  # after the checks: a refused run leaves no files
    module = ConsistencyModule(model, cfg)
    datamodule = ConsistencyDataModule(cfg.data, seed=cfg.seed, with_contrast=cfg.loss.gamma > 0,
                                       image_resize=image_resize_for(model))
    loggers = make_loggers(cfg, run_dir, persist_run_id=True)  # resume / requeue: the same W&B run
    log_run_config(loggers, cfg, model)  # flattened config, git commit, versions, weights fingerprint

    # no version counter: last.ckpt is always the newest checkpoint. With one, a resume whose checkpoint
    # names another folder (the run folder moved, output_dir= changed) does not own the last.ckpt it
    # finds, so it writes last-v1.ckpt and leaves last.ckpt at the old step (resume=<run>/last.ckpt
    # would then go back); "{epoch}-{step}" names never collide between steps
    checkpoint = ModelCheckpoint(dirpath=str(run_dir), filename="{epoch}-{step}", save_last=True, save_top_k=1,
                                 every_n_train_steps=tcfg.checkpoint_every_n_steps, enable_version_counter=False)
    # SlurmRequeue's hooks before the LR monitor's and the evaluations': a stop requested at a batch
    # start or an epoch end comes before anything logs a row for a step the checkpoint does not hold
    callbacks = [checkpoint, LogFilesCallback(loggers), *([requeue.callback] if requeue else []),
                 LearningRateMonitor(logging_interval="step"), *eval_callbacks, *(extra_callbacks or [])]
    plugins = []
    if requeue is not None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        # Lightning would pick SLURMEnvironment by itself, with auto_requeue=True: its SIGUSR1
        # handler checkpoints mid-step (see SlurmRequeue); SlurmRequeue owns the signal instead.
        plugins.append(SLURMEnvironment(auto_requeue=False))
    if tcfg.enable_progress_bar:
        callbacks.append(RichProgressBar())
    trainer = L.Trainer(
        default_root_dir=str(run_dir),
        max_epochs=tcfg.max_epochs,
        max_steps=tcfg.max_steps,
        accelerator=tcfg.accelerator,
        devices=tcfg.devices,
        num_nodes=tcfg.num_nodes,
        strategy=strategy,
        precision=tcfg.precision,
        accumulate_grad_batches=tcfg.accumulate_grad_batches,
        gradient_clip_val=tcfg.gradient_clip_val,
        log_every_n_steps=tcfg.log_every_n_steps,
        limit_train_batches=tcfg.limit_train_batches,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        deterministic=tcfg.deterministic,
        enable_progress_bar=tcfg.enable_progress_bar,
        logger=loggers,
        callbacks=callbacks,
        plugins=plugins or None,
    )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume, weights_only=not cfg.model.allow_pickle)
    except BaseException:
        end_launched_ranks(trainer)
        raise

    export_dir = run_dir / "export"
    if trainer.is_global_zero:
        if str(tcfg.strategy).startswith("deepspeed"):
            export_deepspeed_run(checkpoint.last_model_path, trainer.global_step, export_dir, cfg)
        else:
            export_model(module.model, export_dir, merge=cfg.model.lora.merge_on_export,
                         run_config=OmegaConf.to_container(cfg, resolve=True))
    log_run_artifacts(loggers, cfg, export_dir, run_dir, step=trainer.global_step)  # logger.log_model=true
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    return {
        "run_dir": str(run_dir),
        "ckpt_path": checkpoint.last_model_path or checkpoint.best_model_path or None,
        "export_dir": str(export_dir) if export_dir else None,
        "wandb_dir": wandb_run_dir(loggers),
        "metrics": metrics,
        "global_step": trainer.global_step,
        "counts": dict(module.counts),
    }


def end_launched_ranks(trainer) -> None:
    """Kill the ranks this process launched, when it fails. With ``trainer.devices`` > 1 outside
    SLURM (or torchrun), Lightning's subprocess launcher starts ranks 1.. as children of rank 0 at
    the start of ``fit``. A failing child ends them all (Lightning's observer kills every process);
    a failing rank 0 left the children waiting for it: in the process group's rendezvous (rank 0
    hosts its store) for the 30-minute timeout, or in a collective forever. Under SLURM each rank
    is a task of its own, which ``srun --kill-on-bad-exit=1`` (slurm/train.sbatch) ends when another
    one fails. A no-op in the launched ranks and with one process."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if isinstance(launcher, _SubprocessScriptLauncher):
        launcher.kill(signal.SIGKILL)


def export_deepspeed_run(last_checkpoint: str, global_step: int, export_dir: Path, cfg: DictConfig) -> None:
    """A DeepSpeed run's export, from its last checkpoint folder (written by every rank at the final
    step): Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` gathers the fp32 master
    weights from all ZeRO-2/3 partitions (:func:`unicon.models.checkpoints.read_deepspeed_checkpoint`),
    then :func:`~unicon.models.checkpoints.export_checkpoint` writes ``save_pretrained`` (LoRA merged
    per ``model.lora.merge_on_export``). Under ZeRO-3 no rank holds the whole model in memory, and
    under mixed precision the fp32 master weights are the trained ones, so the checkpoint is the
    source for both stages."""
    # lazy: pulls in every model backend (transformers), not needed by unicon train --help
    from unicon.models.checkpoints import deepspeed_client_state, export_checkpoint

    if not last_checkpoint:
        raise RuntimeError("DeepSpeed run: no checkpoint was written, nothing to export from")
    saved = int(deepspeed_client_state(last_checkpoint, allow_pickle=bool(cfg.model.allow_pickle))["global_step"])
    if saved != global_step:
        raise RuntimeError(f"DeepSpeed run: the last checkpoint {last_checkpoint} is at step {saved}, the run ended at "
                           f"step {global_step}; export it with unicon.models.checkpoints.export_checkpoint")
    export_checkpoint(last_checkpoint, export_dir, merge=cfg.model.lora.merge_on_export,
                      allow_pickle=bool(cfg.model.allow_pickle))
    print(f"export: {export_dir} (converted from the DeepSpeed checkpoint {last_checkpoint})")


def train_from_overrides(overrides: list[str]) -> dict[str, Any]:
    """``train(compose_run(overrides))`` -- convenient in notebooks and tests."""
    return train(compose_run(overrides))
