"""``unicon bench first-batch``: seconds from process start to the first scored batch of a standalone
evaluation, as the code is and with Lightning imported first.

``unicon evaluate <suite>`` imports no Lightning before its first model batch: its loggers are made
after the evaluation, and with ``--logger none`` they need no Lightning at all
(:mod:`unicon.loggers`). This bench measures what that saves. Each run is a fresh Python process
that runs ``unicon evaluate cococon ...`` as the ``unicon`` console script does
(``unicon.cli.main``) and stops at the model's first call (:data:`MODEL_CALLS`: a ``score_*``,
generation or embedding method; for CocoCon the text-to-image check of the first sample), in two
variants:

* ``as_is`` -- the code as it is;
* ``lightning_first`` -- ``import lightning.pytorch`` before ``unicon.cli.main``: what an evaluation
  module importing Lightning (as the epoch-end callbacks do) would add before the first batch.

Lightning's import is mostly torch's compiler stack and torchvision (through torchmetrics), which a
model built on transformers (OFA, Janus) imports anyway; the difference is the rest.

The two alternate within each of ``--repeats`` repetitions (their order swapping every repetition),
after ``--warmup`` untimed runs of the second variant, which warm the file cache for both: these
machines are noisy, so the variants are compared side by side, never timed one after the other.
Per variant: the median and every wall-clock second from the process's start to its first model
call, the CPU seconds of the process by then (less sensitive to other jobs), the number of modules
and the heavy libraries (:data:`HEAVY`) it had imported by then. Beside them the difference and
ratio of the medians, and the load average before and after with the machine's CPU count (what else
was running). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from unicon.errors import UserError

#: the libraries an evaluation needs before its first batch only when its model does (Lightning never)
HEAVY = ("lightning", "deepspeed", "diffusers", "transformers")
#: the model methods whose first call ends a timed run: the scoring, generation and embedding calls
#: of :class:`unicon.models.base.UnifiedModel`
MODEL_CALLS = ("score_text", "score_boxes", "score_image", "score_edit", "caption", "answer", "answer_images",
               "locate", "generate_image", "edit_image", "image_latents", "embed_image", "embed_text",
               "best_of_candidates", "reason")
#: the first word of the line a timed process writes on stderr at its first model call
MARK = "unicon-bench-first-batch:"
#: the variants: the modules imported before ``unicon.cli.main``
VARIANTS = {"as_is": (), "lightning_first": ("lightning.pytorch",)}

#: ``python -c ENTRY <modules to import first, comma-separated> <unicon arguments...>``: imports the
#: modules, wraps :data:`MODEL_CALLS` of the model that ``--ckpt`` loads, and runs ``unicon.cli.main``.
#: At the first model call it writes ``MARK <time.time()> <CPU seconds> <modules> <method> <heavy libraries>``
#: to stderr and, unless ``$UNICON_FIRST_BATCH_CONTINUE`` is set, ends the process (exit 0).
ENTRY = f"""\
import os, sys, time

for name in filter(None, sys.argv.pop(1).split(",")):
    __import__(name)

from unicon.evaluation import cli_common

_load = cli_common.load_model_for
_seen = []


def _first(method, name):
    def call(*args, **kwargs):
        if not _seen:
            _seen.append(name)
            heavy = [m for m in {HEAVY!r} if m in sys.modules]
            print({MARK!r}, repr(time.time()), repr(time.process_time()), len(sys.modules), name, *heavy,
                  file=sys.stderr, flush=True)
            if not os.environ.get("UNICON_FIRST_BATCH_CONTINUE"):
                sys.stdout.flush()
                os._exit(0)
        return method(*args, **kwargs)
    return call


def load_model_for(args):
    model = _load(args)
    for name in {MODEL_CALLS!r}:
        if callable(getattr(model, name, None)):
            setattr(model, name, _first(getattr(model, name), name))
    return model


cli_common.load_model_for = load_model_for  # before the suites' modules import it
from unicon.cli import main

sys.exit(main())
"""


def first_batch_argv(unicon_args: Sequence[str], first: Sequence[str] = (),
                     importtime: bool = False) -> list[str]:
    """The command line of one run: ``unicon <unicon_args>`` through :data:`ENTRY`, with the modules
    ``first`` imported before it (``-X importtime`` reports every import on stderr)."""
    return [sys.executable, *(["-X", "importtime"] if importtime else []), "-c", ENTRY, ",".join(first),
            *unicon_args]


def first_call(stderr: str) -> dict | None:
    """From a run's stderr, its :data:`MARK` line: ``{"time", "cpu_seconds", "modules", "method",
    "heavy"}``; None when the model was never called."""
    for line in stderr.splitlines():
        if line.startswith(MARK):
            words = line.split()
            return {"time": float(words[1]), "cpu_seconds": float(words[2]), "modules": int(words[3]),
                    "method": words[4], "heavy": words[5:]}
    return None


def run_once(unicon_args: Sequence[str], first: Sequence[str] = (), timeout: float = 600.0) -> dict:
    """One fresh process to its first model call: ``{"seconds", "cpu_seconds", "modules", "method",
    "heavy"}`` (:func:`first_call`; ``seconds`` from just before the process started)."""
    argv = first_batch_argv(unicon_args, first)
    start = time.time()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    call = first_call(done.stderr)
    if call is None:
        raise UserError(f"bench first-batch: `unicon {' '.join(unicon_args)}` ended (exit {done.returncode}) "
                        f"before its first model call:\n{done.stderr[-2000:]}")
    return {"seconds": call["time"] - start, **{k: v for k, v in call.items() if k != "time"}}


def evaluate_args(ckpt: str, data: str, max_samples: int, out: str) -> list[str]:
    """The timed command: ``unicon evaluate cococon`` with ``--logger none``."""
    return ["evaluate", "cococon", "--ckpt", ckpt, "--data", data, "--max-samples", str(max_samples),
            "--logger", "none", "--out", out]


def run(ckpt: str, data: str, repeats: int = 3, warmup: int = 1, max_samples: int = 4,
        timeout: float = 600.0) -> dict:
    """The JSON object of ``unicon bench first-batch`` (see the module docstring)."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="unicon-bench-first-batch-") as tmp:
        def one(variant: str, label: str) -> dict:
            out = Path(tmp) / label  # a fresh --out per run: no run finds another's files
            return run_once(evaluate_args(ckpt, data, max_samples, str(out)), VARIANTS[variant], timeout)

        for w in range(warmup):
            one("lightning_first", f"warmup-{w}")
        for r in range(repeats):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                runs[variant].append(one(variant, f"{variant}-{r}"))
    load_after = os.getloadavg()
    result: dict = {"command": "unicon " + " ".join(evaluate_args(ckpt, data, max_samples, "OUT")),
                    "repeats": repeats, "warmup": warmup}
    for variant, timed in runs.items():
        result[variant] = {
            "median_seconds": statistics.median(r["seconds"] for r in timed),
            "seconds": [r["seconds"] for r in timed],
            "median_cpu_seconds": statistics.median(r["cpu_seconds"] for r in timed),
            "modules_at_first_call": timed[-1]["modules"],
            "first_call": timed[-1]["method"],
            "heavy_at_first_call": timed[-1]["heavy"],
        }
    a, b = result["as_is"]["median_seconds"], result["lightning_first"]["median_seconds"]
    result["difference_seconds"] = b - a
    result["ratio"] = b / a
    result["machine"] = {"cpus": os.cpu_count(), "load_average_before": list(load_before),
                         "load_average_after": list(load_after)}
    return result


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unicon bench first-batch", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="checkpoints/shapes_base", help="the model (default: %(default)s)")
    parser.add_argument("--data", default="data/shapes/cococon_test.json",
                        help="the CocoCon file (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each variant (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (default: %(default)s)")
    parser.add_argument("--max-samples", type=int, default=4,
                        help="samples the evaluation loads (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as hung")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.max_samples < 1 or args.timeout <= 0:
        raise UserError("bench first-batch: need --repeats >= 1, --warmup >= 0, --max-samples >= 1 and "
                        "--timeout > 0")
    for flag, path in (("--ckpt", args.ckpt), ("--data", args.data)):
        if not Path(path).exists():
            raise UserError(f"bench first-batch: {flag} {path} does not exist")
    result = run(str(Path(args.ckpt).resolve()), str(Path(args.data).resolve()), args.repeats, args.warmup,
                 args.max_samples, args.timeout)
    print(json.dumps(result, indent=1))
    return 0
