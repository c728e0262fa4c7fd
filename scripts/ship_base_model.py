"""Make a shipped base model (``checkpoints/<experiment>``) from scratch, with its provenance (``make pretrained``).

:data:`MODELS` lists the shipped models: each is an experiment config, the world it trains on (the
``unicon build-data shapes`` options that build it), the evaluations that measure it and the table read
from them. Two steps, each a command of the project, recorded as run:

* ``train --experiment NAME``: builds the world when it is missing, then ``unicon train experiment=NAME``;
  ``runs/NAME/ship.json`` records the command, the world's build command and fingerprint
  (:meth:`unicon.worlds.shapes.World.fingerprint`), the commit of the code (refused when tracked files differ
  from it), the machine and the wall time.
* ``evaluate --experiment NAME``: copies the run's export to ``--out`` (``checkpoints/NAME``) and measures it
  with the suites' own commands; ``<out>/provenance.json`` holds ``ship.json``, every command with its summary
  file, and the model's table (measured value, target where the model has one, met).

``tests/test_shipped_model.py`` re-evaluates ``shapes_base`` and finds the provenance table's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from unicon import jsonsafe  # noqa: E402 - the project's strict JSON, from this checkout
#: steps of the world's CLIP trained for CLIP-S when --clip names no model (the alignment results' setting)
CLIP_STEPS = 500
#: the world with another seed, for the generalisation table
OTHER_SEED = 1
#: (name, argv after `unicon evaluate`, summary file); {model}, {world}, {out}, {clip}, {other_world} are
#: filled in (the CLIP and the other-seed world are made first when an evaluation names them)
BASE_EVALUATIONS = (
    ("shapes", ["shapes", "--ckpt", "{model}", "--world", "{world}", "--out", "{out}/shapes", "--limit", "500",
                "--tasks", "vqa", "caption", "grounding", "t2i", "edit", "--logger", "none"], "shapes_eval.json"),
    ("ureason", ["ureason", "--ckpt", "{model}", "--data", "{world}", "--judge", "exact", "--out", "{out}/ureason",
                 "--logger", "none"], "ureason.json"),
    ("realunify", ["realunify", "--ckpt", "{model}", "--data", "{world}", "--out", "{out}/realunify",
                   "--logger", "none"], "realunify.json"),
    ("alignment", ["alignment", "--ckpt", "{model}", "--data", "{world}", "--clip", "{clip}", "--out",
                   "{out}/alignment", "--logger", "none"], "alignment.json"),
    ("shapes_other_seed", ["shapes", "--ckpt", "{model}", "--world", "{other_world}", "--out", "{out}/shapes_other_seed",
                           "--limit", "500", "--tasks", "vqa", "caption", "grounding", "t2i", "edit", "--logger", "none"],
     "shapes_eval.json"),
)


GEU_CATEGORY_NAMES = ("mental_reconstruction", "mental_tracking", "attentional_focusing", "cognitive_navigation")


def _geu(m: dict, setting: str, what: str) -> float | None:
    """GEU share of ``what`` ("acc" or "parsed") over the four GEU categories, from realunify.json's metrics."""
    n = sum(v for k, v in m.items() if k.startswith("n/") and k[2:] in GEU_CATEGORY_NAMES)
    if not n:
        return None
    if what == "acc":
        return m[f"acc_{setting}/geu"] / 100.0
    return 1.0 - m[f"unparseable_{setting}/geu"] / n


def _get(m: dict, *path: str) -> float | None:
    for key in path:
        m = m.get(key) if isinstance(m, dict) else None
    return float(m) if isinstance(m, (int, float)) else None


#: (target name, evaluation, how to read it from the summary's metrics (a share in [0, 1], or Kendall tau),
#: the model's target or None for a reported figure)
BASE_TARGETS = (
    ("VQA", "shapes", lambda m: _get(m, "vqa_accuracy"), 0.95),
    ("VQA relation questions", "shapes", lambda m: _get(m, "vqa_accuracy/relation"), 0.90),
    ("VQA counting", "shapes", lambda m: _get(m, "vqa_accuracy/count"), 0.95),
    ("exact caption", "shapes", lambda m: _get(m, "caption_match"), 0.85),
    ("localization IoU>=0.5", "shapes", lambda m: _get(m, "loc_iou50"), 0.95),
    ("T2I, prompts without held-out compositions", "shapes", lambda m: _get(m, "t2i_match/no_held_out"), 0.85),
    ("T2I, held-out compositions", "shapes", lambda m: _get(m, "t2i_match/held_out"), None),
    ("exact edits", "shapes", lambda m: _get(m, "edit_match"), 0.70),
    ("relation answer kept when the relation word is flipped", "shapes",
     lambda m: _get(m, "vqa_relation_flip/answer_kept"), None),
    ("think-then-draw chain accuracy", "ureason", lambda m: _get(m, "chain_acc") / 100.0, 0.95),
    ("UReason setting 3", "ureason", lambda m: _get(m, "acc_s3") / 100.0, 0.80),
    ("RealUnify GEU direct (generate), replies parsed", "realunify", lambda m: _geu(m, "direct", "parsed"), 0.95),
    ("RealUnify GEU direct (generate) accuracy", "realunify", lambda m: _geu(m, "direct", "acc"), 0.60),
    ("RealUnify GEU stepwise accuracy", "realunify", lambda m: _geu(m, "stepwise", "acc"), None),
    ("BagelScore decode, replies parsed", "alignment",
     lambda m: 1.0 - _get(m, "bagelscore_decode", "failure_rate"), 0.95),
    ("BagelScore decode tau_b", "alignment", lambda m: _get(m, "bagelscore_decode", "tau_b"), None),
    ("CLIP-S tau_b", "alignment", lambda m: _get(m, "clip_s", "tau_b"), None),
    ("BagelScore decode tau_b minus CLIP-S tau_b", "alignment",
     lambda m: _get(m, "bagelscore_decode", "tau_b") - _get(m, "clip_s", "tau_b"), 0.0),
    ("VQA, world seed 1", "shapes_other_seed", lambda m: _get(m, "vqa_accuracy"), None),
    ("exact caption, world seed 1", "shapes_other_seed", lambda m: _get(m, "caption_match"), None),
    ("localization, world seed 1", "shapes_other_seed", lambda m: _get(m, "loc_iou50"), None),
    # the seed-1 world holds out other compositions than the model's world: its held-out slices mean nothing here
    ("T2I (every prompt), world seed 1", "shapes_other_seed", lambda m: _get(m, "t2i_match"), None),
    ("exact edits, world seed 1", "shapes_other_seed", lambda m: _get(m, "edit_match"), None),
)

#: the probe word of the caption-gap world (its training captions never name it)
CAPGAP_WORD = "purple"
CAPGAP_EVALUATIONS = tuple(
    (f"cococon_{split}", ["cococon", "--ckpt", "{model}", "--data", f"{{world}}/cococon_{split}.json", "--probe-words",
                          CAPGAP_WORD, "--out", f"{{out}}/cococon_{split}", "--logger", "none"], "results.json")
    for split in ("val", "test"))


def _cococon(m: dict, task: str, key: str) -> float | None:
    """CocoCon's ``task`` ``key`` (``C_k``, ``acc@k``, ``caption_acc@k``) at k = 1 as a share, from results.json."""
    value = _get(m, task, key, "1")
    return None if value is None else value / 100.0


def _probe(m: dict, *path: str) -> float | None:
    value = _get(m, "probe", "by_word", CAPGAP_WORD, *path)
    return None if value is None else value / 100.0


CAPGAP_TARGETS = tuple(
    row for split in ("val", "test") for row in (
        *((f"{split}: {task} C_1", f"cococon_{split}", lambda m, t=task: _cococon(m, t, "C_k"), None)
          for task in ("vqa", "localization", "t2i")),
        *((f"{split}: {task} acc@1", f"cococon_{split}", lambda m, t=task: _cococon(m, t, "acc@k"), None)
          for task in ("vqa", "localization", "t2i")),
        (f"{split}: caption acc@1", f"cococon_{split}", lambda m: _cococon(m, "vqa", "caption_acc@k"), None),
        (f"{split}: {CAPGAP_WORD} caption acc@1", f"cococon_{split}", lambda m: _probe(m, "vqa", "caption_acc@k", "1"),
         None),
        (f"{split}: {CAPGAP_WORD} VQA acc@1", f"cococon_{split}", lambda m: _probe(m, "vqa", "acc@k", "1"), None),
    ))


@dataclass(frozen=True)
class ShippedModel:
    """One shipped base model: ``configs/experiment/<name>.yaml`` trained on the world that
    ``unicon build-data shapes --out <world> <world_options>`` builds, measured by ``evaluations``."""

    world: Path
    world_options: tuple[str, ...]
    evaluations: tuple
    targets: tuple


MODELS = {
    "shapes_base": ShippedModel(Path("data/shapes"), (), BASE_EVALUATIONS, BASE_TARGETS),
    # the tasks hold different knowledge: the training captions never name purple, every other task does
    "shapes_capgap_base": ShippedModel(Path("data/shapes_capgap"),
                                       ("--caption-gap", CAPGAP_WORD, "--caption-gap-keep", "0"),
                                       CAPGAP_EVALUATIONS, CAPGAP_TARGETS),
}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def unicon(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "unicon"), *args]


def world_info(world: Path, options: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The world's seed and fingerprint, and (``options``) the command that builds it."""
    from unicon.worlds.shapes import load_world

    w = load_world(world)
    info = {"root": str(world), "seed": w.info.get("seed"), "fingerprint": w.fingerprint(),
            "fingerprint_files": list(w.FINGERPRINT_FILES)}
    if options is not None:
        info["build_command"] = " ".join(["unicon", *build_command(world, options)[1:]])
    return info


def build_command(world: Path, options: tuple[str, ...]) -> list[str]:
    """The ``unicon build-data shapes`` command that builds ``world`` with ``options``."""
    return unicon("build-data", "shapes", "--out", str(world), *options, "--workers", "2")


def build_world(world: Path, options: tuple[str, ...]) -> None:
    """Build ``world`` (:func:`build_command`) when it is missing."""
    if not (REPO / world / "world.json").is_file():
        subprocess.run(build_command(world, options), check=True, cwd=REPO)


def train(args: argparse.Namespace) -> int:
    if git("status", "--porcelain", "--untracked-files=no"):
        print("ship_base_model: tracked files differ from the commit; commit first, so that the provenance names "
              "the code that trained the model", file=sys.stderr)
        return 2
    spec = MODELS[args.experiment]
    world = args.world or spec.world
    build_world(world, spec.world_options)
    run_dir = REPO / "runs" / args.experiment
    command = unicon("train", f"experiment={args.experiment}", f"data.root={world}", "overwrite=true",
                     *args.overrides)
    record = {"command": " ".join(["unicon", *command[1:]]), "git_commit": git("rev-parse", "HEAD"),
              "world": world_info(world, spec.world_options),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "processor": platform.processor()},
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=REPO)
    if proc.returncode:
        return proc.returncode
    record["wall_time_s"] = round(time.monotonic() - t0, 1)
    (run_dir / "ship.json").write_text(jsonsafe.dumps(record, indent=2) + "\n")
    print(f"ship_base_model: trained in {record['wall_time_s']} s; {run_dir / 'ship.json'}")
    return 0


def summary_metrics(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return data.get("metrics", data) if isinstance(data, dict) else {}


def evaluate(args: argparse.Namespace) -> int:
    spec = MODELS[args.experiment]
    world = args.world or spec.world
    run_dir = REPO / "runs" / args.experiment
    ship = json.loads((run_dir / "ship.json").read_text())
    # before the export is copied over the tracked model: whether the code that evaluates differs from its commit
    evaluated_at = {"git_commit": git("rev-parse", "HEAD"),
                    "tracked_files_changed": bool(git("status", "--porcelain", "--untracked-files=no"))}
    out = Path(args.out or f"checkpoints/{args.experiment}")
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((run_dir / "export").iterdir()):
        if path.is_file():
            shutil.copy2(path, out / path.name)
    fill = {"model": str(out), "world": str(world), "out": f"runs/{args.experiment}/ship_eval"}
    extra: dict[str, Any] = {}
    named = " ".join(a for _, argv, _ in spec.evaluations for a in argv)
    if "{other_world}" in named:
        other = Path(args.other_world)
        build_world(other, ("--seed", str(OTHER_SEED), "--quiet"))
        fill["other_world"] = str(other)
        extra["other_world"] = world_info(other)
    if "{clip}" in named:
        clip = Path(args.clip)
        if not clip.is_dir():
            subprocess.run([sys.executable, "-m", "unicon.embedders.clip", "--train-shapes", str(world), "--out",
                            str(clip), "--steps", str(CLIP_STEPS)], check=True, cwd=REPO)
        fill["clip"] = str(clip)
        extra["clip"] = str(clip)
    evaluations: dict[str, Any] = {}
    for name, argv, summary in spec.evaluations:
        argv = [a.format(**fill) for a in argv]
        folder = REPO / argv[argv.index("--out") + 1]
        if folder.exists():
            shutil.rmtree(folder)
        t0 = time.monotonic()
        subprocess.run(unicon("evaluate", *argv), check=True, cwd=REPO)
        evaluations[name] = {"command": " ".join(["unicon", "evaluate", *argv]),
                             "seconds": round(time.monotonic() - t0, 1),
                             "metrics": summary_metrics(folder / summary)}
    table = []
    for target_name, evaluation, read, target in spec.targets:
        try:
            value = read(evaluations[evaluation]["metrics"])
        except (KeyError, TypeError):
            value = None
        table.append({"name": target_name, "evaluation": evaluation, "value": value, "target": target,
                      "met": None if target is None or value is None else value >= target})
    provenance = {"model": str(out), "experiment": args.experiment, **ship, **extra,
                  "evaluated_at": evaluated_at,
                  "evaluations": evaluations, "table": table}
    (out / "provenance.json").write_text(jsonsafe.dumps(provenance, indent=2) + "\n")
    width = max(len(r["name"]) for r in table)
    for r in table:
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        target = "" if r["target"] is None else f">= {r['target']:.2f} {'met' if r['met'] else 'MISSED'}"
        print(f"{r['name']:<{width}}  {value:>7}  {target}")
    print(f"ship_base_model: {out / 'provenance.json'}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/ship_base_model.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("train", help="build the world when missing, train experiment=NAME and record how")
    e = sub.add_parser("evaluate", help="copy the export to --out, evaluate it, write provenance.json")
    for step in (t, e):
        step.add_argument("--experiment", choices=sorted(MODELS), default="shapes_base",
                          help="the shipped model (configs/experiment/NAME.yaml)")
        step.add_argument("--world", type=Path, default=None,
                          help="the world's folder (default: the model's, e.g. data/shapes)")
    t.add_argument("overrides", nargs="*", help="extra config overrides (recorded in the command)")
    e.add_argument("--out", default=None, help="where the model goes (default: checkpoints/NAME)")
    e.add_argument("--other-world", default=f"data/shapes_seed{OTHER_SEED}",
                   help=f"a world built with --seed {OTHER_SEED} (built when missing)")
    e.add_argument("--clip", default="checkpoints/shapes_clip",
                   help="the world's CLIP for CLIP-S (trained by python -m unicon.embedders.clip when missing)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return train(args) if args.step == "train" else evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
