"""``unicon evaluate drift``: semantic-drift chains of one checkpoint, MCD and MGG, resumable.

The flags of ``eval.drift``'s fields are generated from :class:`unicon.config.DriftEvalConfig`
(:func:`~unicon.evaluation.cli_common.add_config_args`), so a standalone run and an epoch-end run
agree; :data:`FLAGS` keeps the flag names users know (``--geneval`` for ``geneval_prompts``,
``--long`` for ``long_prompts``, ``--embedders`` as a comma list) and ``--num-chains`` defaults to
every seed (not the epoch-end subset). ``--shard I/N`` runs the chains of shard I's seeds (the
DistributedSampler partition over the seed list) into ``OUT/<set>/rank-<I>``; ``--merge`` writes
``drift.json`` and the plots from the finished shards, byte-identical to one run. The output
folder holds the chains (``mcd/``, ``mgg/``), the report ``drift.json`` (metrics, model
fingerprint, image-generation settings, git commit and package versions) and the plots; running
the same command again resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from unicon.config import DRIFT_CHAINS, DriftEvalConfig, LoggerConfig
from unicon.data.drift_seeds import balanced, geneval_seeds, is_geneval_file, load_seeds, nd400_seeds
from unicon.data.geneval import geneval_r_path
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.suites import register_suite
from unicon.evaluation.cli_common import (
    Flag, add_common_args, add_config_args, add_image_generation_args, add_shard_args, check_common_args,
    config_argv, config_from_args, image_generation_config, load_model_for, sharding,
)
from unicon import jsonsafe

log = logging.getLogger(__name__)

#: the epoch-end settings, whose values are the defaults of the matching flags
DEFAULTS = DriftEvalConfig()

#: how ``eval.drift``'s fields appear here: the flag names users know, and the standalone defaults
FLAGS = {
    "seeds": Flag("ShapesWorld drift_seeds.jsonl / world dir, or a GenEval metadata file "
                  "(default: the world's drift seeds)"),
    "num_chains": Flag("use only the first N seeds (standalone default: all)", default=None),
    "generations": Flag("generations G of every chain (the paper: 20)"),
    "batch_size": Flag("chains per model call"),
    "i2t_prompt": Flag('captioning prompt, e.g. "Describe the image in detail." (default: the backend\'s)'),
    "embedders": Flag("comma list of scene, clip, text, dino ('' = none)", comma=True),
    "geneval_prompts": Flag("GenEval metadata file for MGG (default: a ShapesWorld's own; otherwise GenEval-R, "
                            "the long BLIP3-o rewrites in the shared data; 'none' skips MGG)",
                            names=("--geneval", "--geneval-prompts"), dest="geneval"),
    "long_prompts": Flag("use the long 'detailed_caption' GenEval prompts", names=("--long", "--long-prompts"),
                         dest="long"),
    "clip": Flag("open_clip dir, '<arch>:<weights file>' or hf-hub:<repo> (the default ShapesWorld CLIP is "
                 "skipped with a warning when it has not been trained)"),
    "dino": Flag("DINO model directory (transformers)"),
    "sentence": Flag("sentence-transformers dir (default: the bundled all-MiniLM-L6-v2)"),
    "strips": Flag("chains shown in the strip plot and table"),
    "detector_threshold": Flag("MGG detector score threshold (default: the detector's reference value: "
                               "owlv2 0.1, mask2former 0.3)"),
}
#: eval.drift fields without a flag: ``geneval`` (MGG on/off) is ``--geneval none`` here
SKIP = ("geneval",)
#: the fields of add_chain_args (shared with ``unicon bench chains``)
CHAIN_FIELDS = ("seeds", "num_chains", "generations", "batch_size", "i2t_prompt")


class Described:
    """The merge's stand-in for an embedder or detector that the shards used: its description, no model."""

    def __init__(self, description):
        self.description = description

    def describe(self):
        return self.description


def add_chain_args(p: argparse.ArgumentParser) -> None:
    """The chain arguments shared with ``unicon bench chains``."""
    p.add_argument("--world", default="data/shapes",
                   help="ShapesWorld root (scene embedder, shapes detector, default seeds)")
    others = [f.name for f in dataclasses.fields(DriftEvalConfig) if f.name not in CHAIN_FIELDS]
    add_config_args(p, DriftEvalConfig, {k: FLAGS[k] for k in CHAIN_FIELDS}, skip=others)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unicon evaluate drift",
        description="Semantic drift chains: run/resume I2T<->T2I chains, compute MCD and MGG.",
    )
    add_common_args(p, out_help="output directory (resumable)")
    add_chain_args(p)
    add_config_args(p, DriftEvalConfig, {k: v for k, v in FLAGS.items() if k not in CHAIN_FIELDS},
                    skip=(*CHAIN_FIELDS, *SKIP))
    add_image_generation_args(p)
    p.add_argument("--chains", default="both", choices=["both", *DRIFT_CHAINS])
    p.add_argument("--nocaps", help="ND400: nocaps_val_4500_captions.json (use instead of --seeds)")
    p.add_argument("--nocaps-images", help="ND400: folder of NoCaps val images")
    p.add_argument("--docci", help="ND400: docci_descriptions.jsonlines")
    p.add_argument("--docci-images", help="ND400: folder of DOCCI images")
    p.add_argument("--nd-n", type=int, default=200, help="ND400: pairs drawn from each source (200 -> 400)")
    p.add_argument("--geneval-limit", type=int, default=None, help="first N prompts of every task")
    p.add_argument("--detector", default="shapes",
                   help="'shapes', 'owlv2:<dir>' (the Telephone-Game reference MGG protocol: colour in the OWLv2 "
                        "query, threshold 0.1 for every prompt type, positions by pixel offsets) or "
                        "'mask2former:<dir>' (GenEval's rules and threshold 0.3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-batch image sampling seeds")
    add_shard_args(p)
    return p


def argv_from_config(cfg) -> list[str]:
    """``eval.drift`` of a run config as this command's arguments: the world is ``data.root``;
    ``eval.drift.geneval=false`` is ``--geneval none``."""
    c = OmegaConf.to_container(cfg.eval.drift, resolve=True)
    argv = ["--world", str(cfg.data.root), *config_argv(c, DriftEvalConfig, FLAGS, skip=SKIP)]
    return argv + ([] if c["geneval"] else ["--geneval", "none"])


@register_suite("drift", "semantic drift chains (MCD, MGG)", section="drift", argv=argv_from_config,
                callback="unicon.evaluation.drift.callback:DriftCallback",
                config=DriftEvalConfig,
                report="unicon.evaluation.drift.report:section", title="Semantic drift",
                headline=("drift/MCD_avg", "drift/MGG"))
def cli(argv: Sequence[str] | None = None) -> int:
    """``unicon evaluate drift --ckpt ... --seeds ... --generations 20 --out DIR``."""
    args = build_parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    from unicon.embedders.factory import load_embedders
    from unicon.evaluation.logs import log_eval_config, log_metrics
    from unicon.evaluation.drift.geneval import ClipColorClassifier, check_detector_spec, load_detector
    from unicon.evaluation.drift.metrics import drift_metrics, without_clip
    from unicon.evaluation.drift.plots import log_plots
    from unicon.evaluation.drift.runner import chains_for, evaluate_drift
    from unicon.loggers import make_loggers
    from unicon.worlds.shapes import load_world

    config_from_args(args, DriftEvalConfig, FLAGS, skip=SKIP)  # ranges and choices, naming the flag
    out = check_common_args(args, ("nd_n", "geneval_limit"))
    check_detector_spec(args.detector)

    world = None
    if Path(args.world, "world.json").is_file():
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
    chains = chains_for(seeds, DRIFT_CHAINS if args.chains == "both" else (args.chains,))

    names = [n for n in args.embedders.split(",") if n]
    if world is None and "scene" in names:
        names.remove("scene")
    if "clip" in names and args.clip == DEFAULTS.clip and not Path(args.clip).exists():
        names.remove("clip")
        log.warning(without_clip(args.clip, args.world, names))
    embedders: dict = {}
    if not args.merge:  # a merge embeds and detects nothing: the shards' records carry the scores
        embedders = load_embedders(names, clip=args.clip, dino=args.dino, sentence=args.sentence,
                                   world_config=world.config if world else None)

    gseeds, detector = None, None
    gpath = args.geneval
    if gpath is None and args.seeds and is_geneval_file(args.seeds):
        gpath = args.seeds  # MGG scores the prompts of the GenEval file given as seeds
    elif gpath is None and not args.seeds and world is not None and world.geneval_path.is_file():
        gpath = str(world.geneval_path)
    long = args.long
    if gpath is None and world is None:  # real data: the paper's GenEval-R prompts (long rewrites)

        gpath, long = str(geneval_r_path()), True
    if gpath and gpath != "none":
        gseeds = geneval_seeds(gpath, long=long, limit=args.geneval_limit, tasks=None)
        if args.num_chains and not args.geneval_limit:
            gseeds = balanced(gseeds, args.num_chains)
        color = None
        if args.detector != "shapes" and "clip" in embedders and not args.merge:
            color = ClipColorClassifier(embedders["clip"])
        if not args.merge:
            detector = load_detector(args.detector, world_cfg=world.config if world else None,
                                     color_classifier=color, threshold=args.detector_threshold)

    # stops at the next batch; the journals make a rerun resume (a shard's chains: OUT/<set>/rank-<i>)
    with sharding(args, out) as shards, preemption.watch_signals():
        model, fingerprint = shards.load_model(args, load_model_for)  # a merge: recorded, no weights
        model_id = {"checkpoint": str(Path(args.ckpt).resolve()), "fingerprint": fingerprint}
        # drift.json describes the embedders and the detector: a merge has the shards' descriptions
        described = shards.record("described", None if args.merge else {
            "embedders": {n: e.describe() for n, e in embedders.items()},
            "detector": detector.describe() if detector is not None else None})
        if shards.mode == "merge":
            embedders = {n: Described(d) for n, d in described["embedders"].items()}
            detector = Described(described["detector"]) if gseeds else None
        report = evaluate_drift(model, out, seeds=seeds, geneval_seeds=gseeds, generations=args.generations,
                                batch_size=args.batch_size, i2t_prompt=args.i2t_prompt, embedders=embedders,
                                detector=detector, chains=chains, image_config=image_generation_config(model, args),
                                strips=args.strips, seed=args.seed, model_id=model_id,
                                geneval_file=str(Path(gpath).resolve()) if gseeds else None)
    if shards.mode == "shard":
        print(f"drift: shard {args.shard} done; merge with --merge once every shard is done")
        return 0
    # --logger none: no W&B or CSV run, but metrics.jsonl, as every suite writes
    loggers = make_loggers(LoggerConfig(type=args.logger, tags=["drift"]), out, name=f"drift-{out.name}",
                           replace=True)
    log_eval_config(loggers, args, model_id["fingerprint"])
    log_metrics(loggers, drift_metrics(report), step=0)
    log_plots(loggers, report, out, step=0)
    for lg in loggers:
        lg.finalize("success")
    summary = {k: report[k] for k in ("MCD_avg", "MCD", "MGG", "MGG_micro") if k in report}
    summary["out"] = str(out)
    summary["repairs"] = len(report["repairs"])
    print(jsonsafe.dumps(summary, indent=1))
    return 0
