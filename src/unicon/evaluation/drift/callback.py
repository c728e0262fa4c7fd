"""The epoch-end drift evaluation: :class:`DriftCallback` runs a small drift evaluation on every rank.

It is given its seeds, embedders and detector; :meth:`DriftCallback.from_config` builds them from
``eval.drift`` and touches ShapesWorld only when ``data.root`` is a ShapesWorld (it holds
``world.json``): then the world's seeds, GenEval prompts, scene embedder and exact detector are
the defaults. On other data, drift needs ``eval.drift.seeds`` and, for MGG,
``eval.drift.geneval_prompts`` and a detector (only ShapesWorld's is available at epoch end).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Sequence

from unicon.config import DriftEvalConfig
from unicon.data.drift_seeds import DriftSeed, balanced, geneval_seeds, load_seeds
from unicon.embedders.base import Embedder
from unicon.embedders.factory import load_embedders
from unicon.errors import UserError
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.drift.geneval import Detector, ShapesDetector
from unicon.evaluation.drift.metrics import CHAINS, drift_metrics, without_clip
from unicon.evaluation.drift.plots import log_plots
from unicon.evaluation.drift.runner import chains_for, evaluate_drift
from unicon.worlds.shapes import load_world

log = logging.getLogger(__name__)


class DriftCallback(EvalCallback):
    """A small drift run at the end of training epochs: ``drift/MCD_avg``, ``drift/MCD_<mapping>``,
    ``drift/MGG``, ... (:func:`unicon.evaluation.drift.metrics.drift_metrics`).

    Every rank runs the chains of its share of the seeds into ``<run_dir>/eval/drift/epoch-<e>``;
    the metrics come from all ranks' records (:mod:`unicon.evaluation.drift.runner`), rank 0
    writes the report and logs the plots."""

    name = "drift"

    def __init__(
        self, *, seeds: Sequence[DriftSeed], geneval_seeds: Sequence[DriftSeed] | None,
        embedders: Mapping[str, Embedder], detector: Detector | None, generations: int, batch_size: int,
        i2t_prompt: str | None, strips: int, every_n_epochs: int, fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs, fail_on_error)
        if geneval_seeds and detector is None:
            raise UserError("drift: MGG (GenEval seeds) needs a detector")
        self.seeds, self.geneval_seeds = list(seeds), list(geneval_seeds or [])
        self.embedders, self.detector = dict(embedders), detector
        self.generations, self.batch_size, self.i2t_prompt, self.strips = generations, batch_size, i2t_prompt, strips

    @classmethod
    def from_config(cls, cfg) -> "DriftCallback":
        """From a RunConfig: ``eval.drift`` (``DriftEvalConfig``), ``data.root`` and ``eval.fail_on_error``.

        Seeds: the first ``num_chains`` of ``eval.drift.seeds`` (default: the world's
        ``drift_seeds.jsonl``). MGG (``eval.drift.geneval``): ``num_chains`` prompts of
        ``geneval_prompts`` (default: the world's ``geneval_metadata.jsonl``) spread over the tasks,
        scored by the ShapesWorld detector. Embedders missing on disk are skipped with a warning."""
        c = cfg.eval.drift
        root = Path(cfg.data.root)
        world = None
        if (root / "world.json").is_file():
            world = load_world(root)
        seeds_file = c.seeds or (world.drift_seeds_path if world else None)
        if seeds_file is None:
            raise UserError(f"eval.drift.seeds: not set and data.root {root} is not a ShapesWorld (no world.json); "
                            "give a seed file (eval.drift.seeds=FILE) or disable drift (eval.drift.enabled=false)")
        seeds = load_seeds(seeds_file)[: c.num_chains]
        gseeds, detector = None, None
        if c.detector_threshold is not None:
            raise UserError(f"eval.drift.detector_threshold={c.detector_threshold}: the epoch-end MGG uses the exact "
                            "ShapesWorld detector, which has no score threshold; the threshold is for `unicon "
                            "evaluate drift --detector owlv2:<dir>` or mask2former:<dir>. Remove the key")
        if c.geneval:
            prompts = c.geneval_prompts or (world.geneval_path if world else None)
            if prompts is None or world is None:
                raise UserError(f"eval.drift.geneval: MGG at epoch end needs the ShapesWorld detector, and data.root "
                                f"{root} is not a ShapesWorld; set eval.drift.geneval=false (MGG of other data: "
                                "`unicon evaluate drift --detector owlv2:<dir>`)")

            gseeds = balanced(geneval_seeds(prompts, long=c.long_prompts, tasks=None), c.num_chains)
            detector = ShapesDetector(world.config)
        names = list(c.embedders)
        if world is None and "scene" in names:
            log.warning("drift: the scene embedder needs a ShapesWorld; data.root %s is not one, skipping it", root)
            names.remove("scene")
        if "clip" in names and c.clip == DriftEvalConfig.clip and not Path(c.clip).exists():
            names.remove("clip")
            log.warning(without_clip(c.clip, str(root), names))
        embedders = load_embedders(names, clip=c.clip, dino=c.dino, sentence=c.sentence,
                                   world_config=world.config if world else None, strict=False)
        return cls(seeds=seeds, geneval_seeds=gseeds, embedders=embedders, detector=detector,
                   generations=c.generations, batch_size=c.batch_size, i2t_prompt=c.i2t_prompt, strips=c.strips,
                   every_n_epochs=c.every_n_epochs, fail_on_error=cfg.eval.fail_on_error)

    def evaluate(self, trainer, model) -> dict[str, float]:
        out = self.output_dir(trainer)
        report = evaluate_drift(
            model, out, seeds=self.seeds, geneval_seeds=self.geneval_seeds, generations=self.generations,
            batch_size=self.batch_size, i2t_prompt=self.i2t_prompt, embedders=self.embedders,
            detector=self.detector, chains=chains_for(self.seeds, CHAINS), strips=self.strips,
        )
        if trainer.is_global_zero:
            log_plots(trainer.loggers, report, out, step=trainer.global_step)
        return drift_metrics(report)
