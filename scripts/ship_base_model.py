"""Make the shipped base model ``checkpoints/shapes_base`` from scratch, with its provenance (``make pretrained``).

Two steps, each a command of the project, recorded as run:

* ``train``: ``unicon train experiment=shapes_base`` on the default world; ``<run>/ship.json`` records the
  command, the commit of the code (refused when tracked files differ from it), the world's fingerprint
  (:meth:`unicon.worlds.shapes.World.fingerprint`), the machine and the wall time.
* ``evaluate``: copies the run's export to ``--out`` and measures it with the suites' own commands
  (:data:`EVALUATIONS`; ``unicon evaluate shapes`` also on a world built with another seed, whose scenes
  the model never saw). ``<out>/provenance.json`` holds ``ship.json``, every command with its summary
  file, and the table of :data:`TARGETS` (measured value, target, met).

``tests/test_shipped_model.py`` re-evaluates the shipped model and finds the provenance table's numbers.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "shapes_base"
#: steps of the world's CLIP trained for CLIP-S when --clip names no model (the alignment results' setting)
CLIP_STEPS = 500
#: the world with another seed, for the generalisation table
OTHER_SEED = 1
#: (name, argv after `unicon evaluate`, summary file); {model}, {world}, {out}, {clip} are filled in
EVALUATIONS = (
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


def _geu(m: dict, setting: str, what: str) -> float | None:
    """GEU share of ``what`` ("acc" or "parsed") over the four GEU categories, from realunify.json's metrics."""
    n = sum(v for k, v in m.items() if k.startswith("n/") and k[2:] in GEU_CATEGORY_NAMES)
    if not n:
        return None
    if what == "acc":
        return m[f"acc_{setting}/geu"] / 100.0
    return 1.0 - m[f"unparseable_{setting}/geu"] / n


GEU_CATEGORY_NAMES = ("mental_reconstruction", "mental_tracking", "attentional_focusing", "cognitive_navigation")


def _get(m: dict, *path: str) -> float | None:
    for key in path:
        m = m.get(key) if isinstance(m, dict) else None
    return float(m) if isinstance(m, (int, float)) else None


#: (target name, evaluation, how to read it from the summary's metrics (a share in [0, 1], or Kendall tau),
#: the issue's target or None for a reported figure)
TARGETS = (
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


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def unicon(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "unicon"), *args]


def world_info(world: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "src"))
    from unicon.worlds.shapes import load_world

    w = load_world(world)
    return {"root": str(world), "seed": w.info.get("seed"), "fingerprint": w.fingerprint(),
            "fingerprint_files": list(w.FINGERPRINT_FILES)}


def train(args: argparse.Namespace) -> int:
    if git("status", "--porcelain", "--untracked-files=no"):
        print("ship_base_model: tracked files differ from the commit; commit first, so that the provenance names "
              "the code that trained the model", file=sys.stderr)
        return 2
    run_dir = REPO / "runs" / EXPERIMENT
    command = unicon("train", f"experiment={EXPERIMENT}", f"data.root={args.world}", "overwrite=true", *args.overrides)
    record = {"command": " ".join(["unicon", *command[1:]]), "git_commit": git("rev-parse", "HEAD"),
              "world": world_info(args.world), "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                                            "processor": platform.processor()},
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=REPO)
    if proc.returncode:
        return proc.returncode
    record["wall_time_s"] = round(time.monotonic() - t0, 1)
    (run_dir / "ship.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"ship_base_model: trained in {record['wall_time_s']} s; {run_dir / 'ship.json'}")
    return 0


def summary_metrics(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return data.get("metrics", data) if isinstance(data, dict) else {}


def evaluate(args: argparse.Namespace) -> int:
    run_dir = REPO / "runs" / EXPERIMENT
    ship = json.loads((run_dir / "ship.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((run_dir / "export").iterdir()):
        if path.is_file():
            shutil.copy2(path, out / path.name)
    other = Path(args.other_world)
    if not (other / "world.json").is_file():
        subprocess.run(unicon("build-data", "shapes", "--out", str(other), "--seed", str(OTHER_SEED), "--quiet",
                              "--workers", "2"), check=True, cwd=REPO)
    clip = Path(args.clip)
    if not (clip / "open_clip_config.json").is_file() and not clip.is_dir():
        subprocess.run([sys.executable, "-m", "unicon.embedders.clip", "--train-shapes", str(args.world), "--out", str(clip),
                        "--steps", str(CLIP_STEPS)], check=True, cwd=REPO)
    evals_dir = run_dir / "ship_eval"
    fill = {"model": str(out), "world": str(args.world), "out": str(evals_dir), "clip": str(clip),
            "other_world": str(other)}
    evaluations: dict[str, Any] = {}
    for name, argv, summary in EVALUATIONS:
        argv = [a.format(**fill) for a in argv]
        folder = Path(argv[argv.index("--out") + 1])
        if folder.exists():
            shutil.rmtree(folder)
        t0 = time.monotonic()
        subprocess.run(unicon("evaluate", *argv), check=True, cwd=REPO)
        evaluations[name] = {"command": " ".join(["unicon", "evaluate", *argv]),
                             "seconds": round(time.monotonic() - t0, 1),
                             "metrics": summary_metrics(folder / summary)}
    table = []
    for target_name, evaluation, read, target in TARGETS:
        try:
            value = read(evaluations[evaluation]["metrics"])
        except (KeyError, TypeError):
            value = None
        table.append({"name": target_name, "evaluation": evaluation, "value": value, "target": target,
                      "met": None if target is None or value is None else value >= target})
    provenance = {"model": str(out), "experiment": EXPERIMENT, **ship, "clip": str(clip),
                  "evaluated_at": {"git_commit": git("rev-parse", "HEAD"),
                                   "tracked_files_changed": bool(git("status", "--porcelain", "--untracked-files=no"))},
                  "other_world": world_info(other), "evaluations": evaluations, "table": table}
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2, allow_nan=False) + "\n")
    width = max(len(r["name"]) for r in table)
    for r in table:
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        target = "" if r["target"] is None else f">= {r['target']:.2f} {'met' if r['met'] else 'MISSED'}"
        print(f"{r['name']:<{width}}  {value:>7}  {target}")
    print(f"ship_base_model: {out / 'provenance.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/ship_base_model.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("train", help="train experiment=shapes_base and record how")
    t.add_argument("--world", type=Path, default=Path("data/shapes"))
    t.add_argument("overrides", nargs="*", help="extra config overrides (recorded in the command)")
    e = sub.add_parser("evaluate", help="copy the export to --out, evaluate it, write provenance.json")
    e.add_argument("--world", type=Path, default=Path("data/shapes"))
    e.add_argument("--out", default="checkpoints/shapes_base")
    e.add_argument("--other-world", default=f"data/shapes_seed{OTHER_SEED}",
                   help=f"a world built with --seed {OTHER_SEED} (built when missing)")
    e.add_argument("--clip", default="checkpoints/shapes_clip",
                   help="the world's CLIP for CLIP-S (trained by python -m unicon.embedders.clip when missing)")
    args = p.parse_args(argv)
    return train(args) if args.step == "train" else evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
