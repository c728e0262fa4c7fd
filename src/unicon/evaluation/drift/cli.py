"""``unicon evaluate drift``: semantic-drift chains of one checkpoint, MCD and MGG, resumable.

Argument defaults are read from :class:`unicon.config.DriftEvalConfig` where a field exists, so
a standalone run and an epoch-end run agree; ``--num-chains`` is the exception (default: every
seed, not the epoch-end subset). The output folder holds the chains (``mcd/``, ``mgg/``), the
report ``drift.json`` (metrics, model fingerprint, image-generation settings, git commit and
package versions) and the plots; running the same command again resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Sequence

from unicon.config import DriftEvalConfig, LoggerConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.callbacks import log_eval_config, log_metrics
from unicon.evaluation.cli_common import (
    add_common_args, add_image_generation_args, check_common_args, image_generation_config, load_model_for,
)
from unicon.evaluation.drift.metrics import CHAINS, drift_metrics

log = logging.getLogger(__name__)

#: the epoch-end settings, whose values are the defaults of the matching flags
DEFAULTS = DriftEvalConfig()


def add_chain_args(p: argparse.ArgumentParser) -> None:
    """The chain arguments shared with ``unicon bench chains``."""
    p.add_argument("--world", default="data/shapes",
                   help="ShapesWorld root (scene embedder, shapes detector, default seeds)")
    p.add_argument("--seeds", default=DEFAULTS.seeds,
                   help="ShapesWorld drift_seeds.jsonl / world dir, or a GenEval metadata file "
                        "(default: the world's drift seeds)")
    p.add_argument("--num-chains", type=int, default=None, help="use only the first N seeds (default: all)")
    p.add_argument("--generations", type=int, default=DEFAULTS.generations,
                   help="generations G of every chain (the paper: 20; default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="default: %(default)s")
    p.add_argument("--i2t-prompt", default=DEFAULTS.i2t_prompt,
                   help='captioning prompt, e.g. "Describe the image in detail." (default: the backend\'s)')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unicon evaluate drift",
        description="Semantic drift chains: run/resume I2T<->T2I chains, compute MCD and MGG.",
    )
    add_common_args(p, out_help="output directory (resumable)")
    add_chain_args(p)
    add_image_generation_args(p)
    p.add_argument("--chains", default="both", choices=["both", *CHAINS])
    p.add_argument("--nocaps", help="ND400: nocaps_val_4500_captions.json (use instead of --seeds)")
    p.add_argument("--nocaps-images", help="ND400: folder of NoCaps val images")
    p.add_argument("--docci", help="ND400: docci_descriptions.jsonlines")
    p.add_argument("--docci-images", help="ND400: folder of DOCCI images")
    p.add_argument("--nd-n", type=int, default=200, help="ND400: pairs drawn from each source (200 -> 400)")
    p.add_argument("--embedders", default=",".join(DEFAULTS.embedders),
                   help="comma list of scene, clip, text, dino ('' = none; default: %(default)s)")
    p.add_argument("--clip", default=DEFAULTS.clip,
                   help="open_clip dir, '<arch>:<weights file>' or hf-hub:<repo> (the default ShapesWorld CLIP is "
                        "skipped with a warning when it has not been trained)")
    p.add_argument("--dino", default=DEFAULTS.dino, help="DINO model directory (transformers)")
    p.add_argument("--sentence", default=DEFAULTS.sentence,
                   help="sentence-transformers dir (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--geneval", default=DEFAULTS.geneval_prompts,
                   help="GenEval metadata file for MGG (default: the world's, if any; 'none' skips MGG)")
    p.add_argument("--long", action="store_true", default=DEFAULTS.long_prompts,
                   help="use the long 'detailed_caption' GenEval prompts")
    p.add_argument("--geneval-limit", type=int, default=None, help="first N prompts of every task")
    p.add_argument("--detector", default="shapes", help="'shapes' or 'owlv2:<dir>'")
    p.add_argument("--strips", type=int, default=DEFAULTS.strips,
                   help="chains shown in the strip plot and table (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-batch image sampling seeds")
    return p


def cli(argv: Sequence[str] | None = None) -> int:
    """``unicon evaluate drift --ckpt ... --seeds ... --generations 20 --out DIR``."""
    args = build_parser().parse_args(argv)
    from unicon.data.drift_seeds import balanced, geneval_seeds, is_geneval_file, load_seeds, nd400_seeds
    from unicon.embedders.factory import load_embedders
    from unicon.evaluation.drift.geneval import ClipColorClassifier, check_detector_spec, load_detector
    from unicon.evaluation.drift.plots import log_plots
    from unicon.evaluation.drift.runner import chains_for, evaluate_drift
    from unicon.core import weights_fingerprint

    out = check_common_args(args, ("num_chains", "generations", "batch_size", "nd_n", "geneval_limit", "strips"),
                            {"strips": 0})
    check_detector_spec(args.detector)

    world = None
    if Path(args.world, "world.json").is_file():
        from unicon.worlds.shapes import load_world

        world = load_world(args.world)
    if args.nocaps or args.docci:
        if not all([args.nocaps, args.nocaps_images, args.docci, args.docci_images]):
            raise UserError("ND400 needs --nocaps, --nocaps-images, --docci and --docci-images")
        seeds = nd400_seeds(args.nocaps, args.nocaps_images, args.docci, args.docci_images,
                            n=args.nd_n, seed=args.seed)
    elif args.seeds:
        seeds = load_seeds(args.seeds, long=args.long)
    elif world is not None:
        seeds = load_seeds(world.drift_seeds_path)
    else:
        raise UserError(f"no seeds: give --seeds FILE or a built world (no {args.world}/world.json)")
    if args.num_chains:
        seeds = seeds[: args.num_chains]
    chains = chains_for(seeds, CHAINS if args.chains == "both" else (args.chains,))

    names = [n for n in args.embedders.split(",") if n]
    if world is None and "scene" in names:
        names.remove("scene")
    if "clip" in names and args.clip == DEFAULTS.clip and not Path(args.clip).exists():
        log.warning("drift: no CLIP model at the default %s (train one with `python -m unicon.embedders.clip "
                    "--train-shapes data/shapes --out %s`); the CLIP mappings are skipped", args.clip, args.clip)
        names.remove("clip")
    embedders = load_embedders(names, clip=args.clip, dino=args.dino, sentence=args.sentence,
                               world_config=world.config if world else None)

    gseeds, detector = None, None
    gpath = args.geneval
    if gpath is None and args.seeds and is_geneval_file(args.seeds):
        gpath = args.seeds  # MGG scores the prompts of the GenEval file given as seeds
    elif gpath is None and not args.seeds and world is not None and world.geneval_path.is_file():
        gpath = str(world.geneval_path)
    if gpath and gpath != "none":
        gseeds = geneval_seeds(gpath, long=args.long, limit=args.geneval_limit, tasks=None)
        if args.num_chains and not args.geneval_limit:
            gseeds = balanced(gseeds, args.num_chains)
        color = None
        if args.detector != "shapes" and "clip" in embedders:
            color = ClipColorClassifier(embedders["clip"])
        detector = load_detector(args.detector, world_cfg=world.config if world else None, color_classifier=color)

    model = load_model_for(args)
    model_id = {"checkpoint": str(Path(args.ckpt).resolve()), "fingerprint": weights_fingerprint(model)}
    with preemption.watch_signals():  # stops at the next batch; the journals make a rerun resume
        report = evaluate_drift(model, out, seeds=seeds, geneval_seeds=gseeds, generations=args.generations,
                                batch_size=args.batch_size, i2t_prompt=args.i2t_prompt, embedders=embedders,
                                detector=detector, chains=chains, image_config=image_generation_config(model, args),
                                strips=args.strips, seed=args.seed, model_id=model_id,
                                geneval_file=str(Path(gpath).resolve()) if gseeds else None)
    if args.logger != "none":
        from unicon.loggers import make_loggers

        loggers = make_loggers(LoggerConfig(type=args.logger, tags=["drift"]), out, name=f"drift-{out.name}")
        log_eval_config(loggers, args, model_id["fingerprint"])
        log_metrics(loggers, drift_metrics(report), step=0)
        log_plots(loggers, report, out, step=0)
        for lg in loggers:
            lg.finalize("success")
    summary = {k: report[k] for k in ("MCD_avg", "MCD", "MGG", "MGG_micro") if k in report}
    summary["out"] = str(out)
    summary["repairs"] = len(report["repairs"])
    print(json.dumps(summary, indent=1))
    return 0
