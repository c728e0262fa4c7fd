"""The drift suite: ``unicon evaluate drift`` and ``eval.drift`` at epoch end, semantic-drift chains of
a model (alternating I2T and T2I generations), scored by MCD and MGG
(:func:`~unicon.evaluation.drift.runner.evaluate_drift`; files: :mod:`unicon.evaluation.drift.runner`).

``eval.drift.geneval`` (MGG on/off) has no flag: it is ``--geneval none`` (:data:`SKIP`). The world is
``--world`` (at epoch end ``data.root``); ND400 (``--nocaps``, ``--docci``) replaces ``--seeds``.

Where the world is a ShapesWorld (it holds ``world.json``), its drift seeds, GenEval prompts, scene
embedder and exact detector are the defaults; on other data drift needs ``seeds`` and, for MGG,
GenEval prompts (standalone default: GenEval-R) and a model detector (``--detector owlv2:<dir>`` or
``mask2former:<dir>``; at epoch end only ShapesWorld's exact one, hence no ``detector_threshold``).
The default CLIP is skipped with a warning when it has not been trained. Seeds, embedders and the
detector are loaded before the model (at epoch end: before training).

``--shard I/N`` runs the chains of shard I's seeds into ``OUT/<set>/rank-<I>``; ``--merge`` writes
``drift.json`` and the plots from the finished shards without loading embedders or detector (the
shards recorded their descriptions).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from unicon.config import DRIFT_CHAINS, DriftEvalConfig
from unicon.errors import UserError
from unicon.evaluation.cli_common import Flag, add_config_args
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

log = logging.getLogger(__name__)

#: how ``eval.drift``'s fields appear on the command line: the flag names users know, and the standalone defaults
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


def _add_world_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", default="data/shapes",
                   help="ShapesWorld root (scene embedder, shapes detector, default seeds)")


def add_chain_args(p: argparse.ArgumentParser) -> None:
    """The chain arguments shared with ``unicon bench chains``."""
    _add_world_arg(p)
    others = [f.name for f in dataclasses.fields(DriftEvalConfig) if f.name not in CHAIN_FIELDS]
    add_config_args(p, DriftEvalConfig, {k: FLAGS[k] for k in CHAIN_FIELDS}, skip=others)


class Described:
    """The merge's stand-in for an embedder or detector that the shards used: its description, no model."""

    def __init__(self, description):
        self.description = description

    def describe(self):
        return self.description


@dataclasses.dataclass
class DriftInputs:
    """What :meth:`DriftSuite.load` prepares: the seeds of the MCD chains, the GenEval seeds of the MGG
    chains (empty: no MGG), the embedders and the detector (a merge's: none), the chains to run and
    the GenEval file the MGG prompts come from (standalone)."""

    seeds: list
    geneval_seeds: list
    embedders: dict
    detector: Any
    chains: tuple
    geneval_file: str | None = None


class DriftSuite(EvalSuite):
    name = "drift"
    help = "semantic drift chains (MCD, MGG)"
    description = "Semantic drift chains: run/resume I2T<->T2I chains, compute MCD and MGG."
    config = DriftEvalConfig
    flags = FLAGS
    skip = SKIP
    out_help = "output directory (resumable)"
    counts = ("nd_n", "geneval_limit")
    report = "unicon.evaluation.drift.report:section"
    title = "Semantic drift"
    headline = ("drift/MCD_avg", "drift/MGG")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _add_world_arg(p)
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

    def argv(self, run_cfg) -> list[str]:
        """The world is ``data.root``; ``eval.drift.geneval=false`` is ``--geneval none``."""
        geneval = self.section_values(run_cfg)["geneval"]
        return ["--world", str(run_cfg.data.root), *super().argv(run_cfg)] + ([] if geneval else ["--geneval", "none"])

    def load(self, config, args, root):
        return self._standalone_inputs(config, args) if args is not None else self._epoch_end_inputs(config, root)

    @staticmethod
    def _embedders(c, world, where: str, standalone: bool, merge: bool = False) -> dict:
        """The embedders of ``c.embedders`` that can run here (``where``: the world's path, for the
        messages); the default CLIP, when untrained, is skipped with a warning. Epoch end: a missing
        one is skipped (logged); standalone it is an error."""
        from unicon.embedders.factory import load_embedders
        from unicon.evaluation.drift.metrics import without_clip

        names = list(c.embedders)
        if world is None and "scene" in names:
            if not standalone:
                log.warning("drift: the scene embedder needs a ShapesWorld; data.root %s is not one, skipping it",
                            where)
            names.remove("scene")
        if "clip" in names and c.clip == DriftEvalConfig.clip and not Path(c.clip).exists():
            names.remove("clip")
            log.warning(without_clip(c.clip, where, names))
        if merge:  # a merge embeds nothing: the shards' records carry the scores
            return {}
        extra = {} if standalone else {"strict": False}
        return load_embedders(names, clip=c.clip, dino=c.dino, sentence=c.sentence,
                              world_config=world.config if world else None, **extra)

    def _standalone_inputs(self, c, args) -> DriftInputs:
        """``--world``, ``--seeds`` or ND400, ``--geneval`` (default: the world's, else GenEval-R) and
        ``--detector``; a merge loads no embedder or detector."""
        from unicon.data.drift_seeds import balanced, geneval_seeds, is_geneval_file, load_seeds, nd400_seeds
        from unicon.data.geneval import geneval_r_path
        from unicon.evaluation.drift.geneval import ClipColorClassifier, check_detector_spec, load_detector
        from unicon.evaluation.drift.runner import chains_for
        from unicon.worlds.shapes import load_world

        check_detector_spec(args.detector)
        world = load_world(args.world) if Path(args.world, "world.json").is_file() else None
        if args.nocaps or args.docci:
            if not all([args.nocaps, args.nocaps_images, args.docci, args.docci_images]):
                raise UserError("ND400 needs --nocaps, --nocaps-images, --docci and --docci-images")
            seeds = nd400_seeds(args.nocaps, args.nocaps_images, args.docci, args.docci_images,
                                n=args.nd_n, seed=args.seed)
        elif c.seeds:
            seeds = load_seeds(c.seeds, long=c.long_prompts)
        elif world is not None:
            seeds = load_seeds(world.drift_seeds_path)
        else:
            raise UserError(f"no seeds: give --seeds FILE or a built world (no {args.world}/world.json)")
        if c.num_chains:
            seeds = seeds[: c.num_chains]
        chains = chains_for(seeds, DRIFT_CHAINS if args.chains == "both" else (args.chains,))
        embedders = self._embedders(c, world, args.world, standalone=True, merge=args.merge)

        gseeds, detector = [], None
        gpath = c.geneval_prompts
        if gpath is None and c.seeds and is_geneval_file(c.seeds):
            gpath = c.seeds  # MGG scores the prompts of the GenEval file given as seeds
        elif gpath is None and not c.seeds and world is not None and world.geneval_path.is_file():
            gpath = str(world.geneval_path)
        long = c.long_prompts
        if gpath is None and world is None:  # real data: the paper's GenEval-R prompts (long rewrites)
            gpath, long = str(geneval_r_path()), True
        if gpath and gpath != "none":
            gseeds = geneval_seeds(gpath, long=long, limit=args.geneval_limit, tasks=None)
            if c.num_chains and not args.geneval_limit:
                gseeds = balanced(gseeds, c.num_chains)
            if not args.merge:  # a merge detects nothing
                color = None
                if args.detector != "shapes" and "clip" in embedders:
                    color = ClipColorClassifier(embedders["clip"])
                detector = load_detector(args.detector, world_cfg=world.config if world else None,
                                         color_classifier=color, threshold=c.detector_threshold)
        return DriftInputs(seeds, list(gseeds), embedders, detector, chains,
                           geneval_file=str(Path(gpath).resolve()) if gseeds else None)

    def _epoch_end_inputs(self, c, root) -> DriftInputs:
        """Seeds: the first ``num_chains`` of ``c.seeds`` (default: the world's ``drift_seeds.jsonl``).
        MGG (``c.geneval``): ``num_chains`` prompts of ``c.geneval_prompts`` (default: the world's
        ``geneval_metadata.jsonl``) spread over the tasks, scored by the ShapesWorld detector.
        Embedders missing on disk are skipped with a warning."""
        from unicon.data.drift_seeds import balanced, geneval_seeds, load_seeds
        from unicon.evaluation.drift.geneval import ShapesDetector
        from unicon.evaluation.drift.runner import chains_for
        from unicon.worlds.shapes import load_world

        world = load_world(root) if root is not None and Path(root, "world.json").is_file() else None
        seeds_file = c.seeds or (world.drift_seeds_path if world else None)
        if seeds_file is None:
            raise UserError(f"eval.drift.seeds: not set and data.root {root} is not a ShapesWorld (no world.json); "
                            "give a seed file (eval.drift.seeds=FILE) or disable drift (eval.drift.enabled=false)")
        seeds = load_seeds(seeds_file)[: c.num_chains]
        if c.detector_threshold is not None:
            raise UserError(f"eval.drift.detector_threshold={c.detector_threshold}: the epoch-end MGG uses the exact "
                            "ShapesWorld detector, which has no score threshold; the threshold is for `unicon "
                            "evaluate drift --detector owlv2:<dir>` or mask2former:<dir>. Remove the key")
        gseeds, detector = [], None
        if c.geneval:
            prompts = c.geneval_prompts or (world.geneval_path if world else None)
            if prompts is None or world is None:
                raise UserError(f"eval.drift.geneval: MGG at epoch end needs the ShapesWorld detector, and data.root "
                                f"{root} is not a ShapesWorld; set eval.drift.geneval=false (MGG of other data: "
                                "`unicon evaluate drift --detector owlv2:<dir>`)")
            gseeds = balanced(geneval_seeds(prompts, long=c.long_prompts, tasks=None), c.num_chains)
            detector = ShapesDetector(world.config)
        embedders = self._embedders(c, world, str(root), standalone=False)
        return DriftInputs(seeds, list(gseeds), embedders, detector, chains_for(seeds, DRIFT_CHAINS))

    def run(self, run: EvalRun) -> Outcome:
        from unicon import jsonsafe
        from unicon.evaluation.drift.metrics import drift_metrics
        from unicon.evaluation.drift.runner import evaluate_drift

        c, inputs, args = run.config, run.inputs, run.args
        embedders, detector = inputs.embedders, inputs.detector
        # drift.json describes the embedders and the detector: a merge has the shards' descriptions
        described = run.record("described", None if run.merging else {
            "embedders": {n: e.describe() for n, e in embedders.items()},
            "detector": detector.describe() if detector is not None else None})
        if run.merging:
            embedders = {n: Described(d) for n, d in described["embedders"].items()}
            detector = Described(described["detector"]) if inputs.geneval_seeds else None
        model_id = None
        if run.standalone:
            model_id = {"checkpoint": run.checkpoint_info()["checkpoint"], "fingerprint": run.fingerprint}
        # the journals make a rerun resume (a shard's chains: OUT/<set>/rank-<i>)
        report = evaluate_drift(run.model, run.out, seeds=inputs.seeds, geneval_seeds=inputs.geneval_seeds,
                                generations=c.generations, batch_size=c.batch_size, i2t_prompt=c.i2t_prompt,
                                embedders=embedders, detector=detector, chains=inputs.chains,
                                image_config=run.image_config(), strips=c.strips,
                                seed=0 if args is None else args.seed, model_id=model_id,
                                geneval_file=inputs.geneval_file)
        summary = ""
        if run.standalone and run.is_writer:
            shown = {k: report[k] for k in ("MCD_avg", "MCD", "MGG", "MGG_micro") if k in report}
            shown["out"] = str(run.out)
            shown["repairs"] = len(report["repairs"])
            summary = jsonsafe.dumps(shown, indent=1)
        return Outcome(drift_metrics(report), summary=summary, result=report)

    def log_media(self, loggers, outcome: Outcome, out, step: int) -> None:
        """The curves, the MGG heatmap, the strips and their table
        (:func:`~unicon.evaluation.drift.plots.log_plots`)."""
        from unicon.evaluation.drift.plots import log_plots

        log_plots(loggers, outcome.result, out, step=step)


register(DriftSuite())
