"""CocoCon model calls: score and generate over samples, gather across ranks, write the outputs.

For every sample the model scores, through :class:`~unicon.models.base.UnifiedModel`, the gold
output and each contrast output of four tasks (NLL, lower = more likely):

==============  ==================================================  =========================
task            gold vs contrast k                                  interface call
==============  ==================================================  =========================
caption         ``caption`` vs ``mutex_caption`` (anchor task t_0)  ``score_text`` (output varies)
vqa             ``answer`` vs ``mutex_answer`` for ``query``         ``score_text`` (output varies)
localization    gold box under ``detection`` vs ``mutex_detection``  ``score_boxes`` (input varies)
t2i             gold image under ``caption`` vs ``mutex_caption``    ``score_image`` (input varies)
==============  ==================================================  =========================

Scores are the length-normalised NLLs of :class:`~unicon.models.base.Scores` (the paper scores
with the cross-entropy loss, section 6). Gold and contrast texts go through the same
:func:`normalize_text` before scoring. When a sample has several gold ``boxes`` the first one is
the fixed localization output (the output must be the same for gold and contrast inputs);
``locate()`` accuracy accepts any gold box. Candidates the model truncated to its maximum length are
counted in ``truncated_candidates``: truncation can make gold and contrast identical and so produce
ties. With ``generative`` the model also captions, answers, locates and (with a ShapesWorld root or
FID weights) draws every sample.

Each rank keeps one record per sample of its :func:`shard_indices`, keyed by the sample's file index,
and :meth:`CocoConEvaluator.compute` computes the metrics from every rank's records
(:mod:`unicon.evaluation.distributed`). Two diagnostics are summed over ranks instead:
``truncated_candidates`` counts per scoring call, so it also counts the candidates of the up to
``world_size - 1`` padding repeats; FID leaves those repeats out.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Sequence

import numpy as np
import torch

from unicon import jsonsafe
from unicon.data.cococon import CocoConSample
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.cococon.metrics import (
    GENERATED,
    MAX_K,
    SCORED,
    TASKS,
    box_iou,
    consistency_metrics,
    flat_metrics,
    generative_metrics,
    names_any,
    normalize_answer,
    vqa_soft_accuracy,
)
from unicon.evaluation.cococon.plots import plot_results
from unicon.evaluation.distributed import gather_objects, gather_records, metric_sync_kwargs, padding_repeats, shard_indices
from unicon.worlds.shapes import NotAShapesWorldImage, load_world, parse
from unicon.worlds.shapes_text import caption_matches


def normalize_text(text: str) -> str:
    """Case/whitespace normalisation applied to gold *and* contrast texts before scoring."""
    return " ".join(text.strip().lower().split())


# ---------------------------------------------------------------------------------------------
# Scoring one batch through the UnifiedModel interface
# ---------------------------------------------------------------------------------------------
def _to_rows(scores, width: int) -> torch.Tensor:
    """``Scores`` -> float64 ``[B, width]`` with NaN where no candidate."""
    nll = scores.nll.detach().to(torch.float64)
    out = torch.full((nll.shape[0], width), float("nan"), dtype=torch.float64, device=nll.device)
    k = min(width, nll.shape[1])
    out[:, :k] = torch.where(scores.mask[:, :k], nll[:, :k], torch.full_like(nll[:, :k], float("nan")))
    return out


def score_samples(model, samples: Sequence[CocoConSample], images: list, width: int,
                  caption_prompt: str | None = None, tasks: Sequence[str] = TASKS,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """NLLs ``[B, width]`` per task (column 0 = gold, column 1+j = contrast set j, NaN = absent or
    task not selected) and the number of candidates each task had to truncate (``Scores.num_truncated``)."""
    B = len(samples)
    prompt = caption_prompt or model.caption_prompt
    captions = [[normalize_text(s.caption)] + [normalize_text(c.caption) for c in s.contrast_sets] for s in samples]
    answers = [[normalize_text(s.answer)] + [normalize_text(c.answer) for c in s.contrast_sets] for s in samples]
    calls = {
        "caption": lambda: model.score_text(images, [prompt] * B, captions),
        "vqa": lambda: model.score_text(images, [s.query for s in samples], answers),  # as training does
        "t2i": lambda: model.score_image(captions, images),
    }
    scores = {task: _call(task, samples, fn) for task, fn in calls.items() if task == "caption" or task in tasks}
    out = {task: _to_rows(sc, width) for task, sc in scores.items()}
    truncated = {task: int(sc.num_truncated) for task, sc in scores.items()}
    nan_rows = torch.full_like(out["caption"], float("nan"))
    out.setdefault("vqa", nan_rows.clone())
    out.setdefault("t2i", nan_rows.clone())
    loc = nan_rows.clone()
    idx = [b for b, s in enumerate(samples) if s.has_localization] if "localization" in tasks else []
    if idx:
        exprs, columns = [], []
        for b in idx:
            s = samples[b]
            cols = [0] + [1 + j for j, c in enumerate(s.contrast_sets) if c.detection is not None]
            contrast_exprs = [normalize_text(s.contrast_sets[c - 1].detection) for c in cols[1:]]
            exprs.append([normalize_text(s.detection)] + contrast_exprs)
            columns.append(cols)
        loc_scores = _call("localization", [samples[b] for b in idx], lambda: model.score_boxes(
            [images[b] for b in idx], exprs, [samples[b].boxes[0] for b in idx]))
        truncated["localization"] = int(loc_scores.num_truncated)
        rows = _to_rows(loc_scores, width)
        for r, (b, cols) in enumerate(zip(idx, columns)):
            loc[b, cols] = rows[r, : len(cols)].to(loc.device)
    out["localization"] = loc
    return out, truncated


def _call(task: str, samples: Sequence[CocoConSample], fn):
    """Run one scoring call; a failure names the task and the samples (use ``tasks`` to skip a task)."""
    try:
        return fn()
    except Exception as e:
        ids = [s.id for s in samples]
        raise RuntimeError(f"CocoCon {task} scoring failed on sample ids {ids[:8]}{'...' if len(ids) > 8 else ''}: "
                           f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# The evaluator: batches -> per-sample records -> gathered -> metrics
# ---------------------------------------------------------------------------------------------
@dataclass
class CocoConResult:
    results: dict  # nested metrics (written to results.json)
    per_sample: list[dict]  # one row per sample (written to per_sample.jsonl)

    def flat(self, prefix: str = "cococon") -> dict[str, float]:
        return flat_metrics(self.results, prefix)


class SceneChecker:
    """Exact T2I check on ShapesWorld: parse the generated image, test the gold caption on it."""

    def __init__(self, world_root: Path):
        self.cfg = load_world(world_root).config

    def __call__(self, image, caption: str) -> float:
        try:
            scene = parse(image, self.cfg)
        except NotAShapesWorldImage:
            return 0.0
        return float(bool(caption_matches(caption, scene, self.cfg)))


def make_fid(weights: str):
    """torchmetrics' FID (2048-d Inception features) from a local weights file."""
    path = Path(weights)
    if not path.is_file():
        raise UserError(f"--fid-weights: no Inception weights file at {path}")
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance

        return FrechetInceptionDistance(feature=2048, normalize=True, feature_extractor_weights_path=str(path),
                                        **metric_sync_kwargs())
    except (ImportError, ModuleNotFoundError) as e:
        raise UserError(f"FID needs torchmetrics' Inception extractor (torch-fidelity): {e}") from None


class CocoConEvaluator:
    """Scores and generates batches of samples, keeps one record per sample; :meth:`compute`
    gathers the records of every rank and returns the metrics."""

    def __init__(self, samples: Sequence[CocoConSample], max_k: int = MAX_K, generative: bool = True,
                 world_root: str | Path | None = None, fid_weights: str | None = None,
                 caption_prompt: str | None = None, cider_tokenizer: str = "auto", device=None,
                 tasks: Sequence[str] = TASKS, probe_words: Sequence[str] = (), image_config=None):
        unknown = sorted(set(tasks) - set(TASKS))
        if unknown or not tasks:
            raise UserError(f"CocoCon tasks must be a non-empty subset of {list(TASKS)}, got {list(tasks)}")
        self.tasks = tuple(t for t in TASKS if t in tasks)
        self.probe_words = tuple(probe_words)
        self.samples = {s.index: s for s in samples}
        self.max_k = max_k
        self.generative = generative
        self.caption_prompt = caption_prompt
        self.cider_tokenizer = cider_tokenizer
        self.image_config = image_config  # ImageGenerationConfig for T2I; None = the model's own
        self.width = 1 + max((len(s.contrast_sets) for s in samples), default=0)
        self.records: dict[int, dict] = {}  # sample index -> {"nll": {task: row}, "generated": {...}}
        self.truncated: Counter = Counter({t: 0 for t in SCORED})
        self.scene_checker = None
        is_world = world_root is not None and (Path(world_root) / "world.json").is_file()
        if generative and "t2i" in self.tasks and is_world:
            self.scene_checker = SceneChecker(Path(world_root))
        self.fid = None
        if generative and "t2i" in self.tasks and fid_weights:
            self.fid = make_fid(fid_weights)
            if device is not None:
                self.fid = self.fid.to(device)

    @torch.no_grad()
    def update(self, model, samples: Sequence[CocoConSample], repeats: Collection[int] = ()) -> None:
        """Score (and generate) ``samples``. ``repeats``: indices of padding repeats whose record
        another rank keeps; they are scored like the others but left out of FID."""
        images = [s.load_image() for s in samples]
        nll, truncated = score_samples(model, samples, images, self.width, self.caption_prompt, self.tasks)
        self.truncated.update(truncated)
        generated = self._generate(model, samples, images, repeats) if self.generative else None
        for b, s in enumerate(samples):
            record: dict[str, Any] = {"nll": {t: nll[t][b].tolist() for t in SCORED}}
            if generated is not None:
                record["generated"] = {name: values[b] for name, values in generated.items()}
            self.records[s.index] = record

    def _generate(self, model, samples, images, repeats: Collection[int]) -> dict[str, list]:
        """Per sample: ``caption``, ``answer`` (whole strings) and the outcomes of :data:`GENERATED`."""
        B = len(samples)
        out: dict[str, list] = {"caption": model.caption(images), "answer": [""] * B}
        out.update({name: [float("nan")] * B for name in GENERATED})
        if "vqa" in self.tasks:
            out["answer"] = model.answer(images, [s.query for s in samples])
            out["vqa_match"] = [float(normalize_answer(a) == normalize_answer(s.answer))
                                for a, s in zip(out["answer"], samples)]
            out["vqa_soft"] = [vqa_soft_accuracy(a, s.answers) if s.answers and len(s.answers) == 10 else float("nan")
                               for a, s in zip(out["answer"], samples)]
        idx = [b for b, s in enumerate(samples) if s.has_localization] if "localization" in self.tasks else []
        if idx:
            boxes = model.locate([images[b] for b in idx], [samples[b].detection for b in idx])
            for b, box in zip(idx, boxes.tolist()):
                out["loc_iou"][b] = max(box_iou(box, g) for g in samples[b].boxes)
        if self.scene_checker is not None or self.fid is not None:
            generated = model.generate_image([normalize_text(s.caption) for s in samples], config=self.image_config)
            if self.scene_checker is not None:
                out["t2i_match"] = [self.scene_checker(im, s.caption) for im, s in zip(generated, samples)]
            kept = [b for b, s in enumerate(samples) if s.index not in repeats]
            if self.fid is not None and kept:
                # lazy: unicon.models.base runs unicon.models/__init__ (every backend); only FID needs it
                from unicon.models.base import pil_to_tensor

                size = images[0].size
                real = pil_to_tensor([images[b].resize(size) for b in kept]).to(self.fid.device)
                fake = pil_to_tensor([generated[b].resize(size) for b in kept]).to(self.fid.device)
                self.fid.update(real, real=True)
                self.fid.update(fake, real=False)
        return out

    def compute(self) -> CocoConResult:
        """Gather every rank's records (a collective call under DDP) and compute the metrics."""
        records = gather_records(self.records)
        if not records:
            raise ValueError("CocoConEvaluator.compute() called before any update")
        truncated = sum(gather_objects(self.truncated), Counter())
        samples = [self.samples[i] for i in records]
        nll = {t: np.array([r["nll"][t] for r in records.values()], dtype=np.float64) for t in SCORED}
        probe = ({w: [names_any(s.answer, [w]) for s in samples] for w in self.probe_words}
                 if self.probe_words else None)
        results, per_task = consistency_metrics(nll, [s.category for s in samples], self.max_k, self.tasks, probe)
        if probe is not None:
            results["probe"]["words"] = list(self.probe_words)
        results["num_samples"] = len(samples)
        results["max_k"] = self.max_k
        # candidates cut to the model's max length: their scores (and possible ties) are affected
        results["truncated_candidates"] = {t: int(truncated[t]) for t in SCORED}
        generated = [r["generated"] for r in records.values()] if self.generative else None
        if generated is not None:
            outcomes = {name: np.array([g[name] for g in generated], dtype=np.float64) for name in GENERATED}
            results["generative"] = generative_metrics(
                [s.references for s in samples], [g["caption"] for g in generated], outcomes, self.tasks,
                scene_checked=self.scene_checker is not None, cider_tokenizer=self.cider_tokenizer)
            if "t2i" in self.tasks:
                results["generative"]["t2i_fid"] = float(self.fid.compute()) if self.fid is not None else "unavailable"
        per_sample = [self._row(i, s, nll, per_task[i], generated[i] if generated else None)
                      for i, s in enumerate(samples)]
        return CocoConResult(results, per_sample)

    def _row(self, i: int, s: CocoConSample, nll: dict[str, np.ndarray], per_task: dict,
             generated: dict | None) -> dict:
        """One line of ``per_sample.jsonl``."""
        row = {
            "index": s.index, "id": s.id, "question_id": s.question_id, "image_id": s.image_id,
            "file_name": s.file_name, "category": s.category,
            "caption": normalize_text(s.caption), "query": s.query, "answer": normalize_text(s.answer),
            "detection": s.detection,
            "contrast_captions": [normalize_text(c.caption) for c in s.contrast_sets],
            "contrast_answers": [normalize_text(c.answer) for c in s.contrast_sets],
            "nll": {t: [None if math.isnan(v) else v for v in nll[t][i, : 1 + len(s.contrast_sets)].tolist()]
                    for t in SCORED},
        }
        for t in TASKS:  # a task without any score for this sample (not selected / no localization)
            if t not in self.tasks or (t == "localization" and not s.has_localization):
                row["nll"][t] = None
        for t in self.tasks:
            p = per_task[t]
            row[t] = {"order": p["order"], "consistent": p["consistent"], "tie": p["tie"],
                      "acc": p["task_acc"], "rho": p["rho"]}
        if generated is not None:
            row["generated"] = {"caption": generated["caption"], "answer": generated["answer"],
                                **{k: (None if math.isnan(generated[k]) else float(generated[k])) for k in GENERATED}}
        return row


def evaluate_model(model, samples: Sequence[CocoConSample], batch_size: int = 16, **evaluator_kwargs) -> CocoConResult:
    """Evaluate ``samples`` with this rank's :func:`shard_indices` (all of them without a process
    group) and return the metrics over every sample, the same on every rank."""
    if not samples:
        raise ValueError("no CocoCon samples to evaluate")
    device = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    ev = CocoConEvaluator(samples, device=device, **evaluator_kwargs)
    shard = [samples[i] for i in shard_indices(len(samples))]
    repeats = {samples[i].index for i in padding_repeats(len(samples))}
    for batch in preemption.batches(shard, batch_size, "cococon: scoring"):
        ev.update(model, batch, repeats)
    return ev.compute()


def generation_settings(model, evaluator_kwargs: dict) -> dict:
    """What the generative outputs depend on, for ``results.json``: the captioning prompt, the
    T2I sampling recipe (``ImageGenerationConfig``) and the CIDEr tokenizer; captions and answers
    are decoded with the backend's own settings."""
    image_config = evaluator_kwargs.get("image_config") or model.image_generation_config
    return {"caption_prompt": evaluator_kwargs.get("caption_prompt") or model.caption_prompt,
            "image": dataclasses.asdict(image_config),
            "cider_tokenizer": evaluator_kwargs.get("cider_tokenizer", "auto")}


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
def write_outputs(result: CocoConResult, out_dir: Path) -> None:
    """``results.json``, ``per_sample.jsonl`` and the two plots."""
    out_dir.mkdir(parents=True, exist_ok=True)  # strict JSON: an undefined metric (NaN) is null
    (out_dir / "results.json").write_text(jsonsafe.dumps(result.results, indent=2, default=_json_default) + "\n")
    with (out_dir / "per_sample.jsonl").open("w") as f:
        for row in result.per_sample:
            f.write(jsonsafe.dumps(row, default=_json_default) + "\n")
    plot_results(result.results, out_dir)


#: the columns of the sample table that the epoch-end callback and ``unicon evaluate cococon`` log
TABLE_COLUMNS = ["image", "id", "caption", "hardest_contrast", "answer", "contrast_answer",
                 "caption_nll", "vqa_nll", "t2i_nll", "vqa_consistent", "localization_consistent", "t2i_consistent"]


def table_rows(result: CocoConResult, samples: dict[int, CocoConSample], n: int) -> list[list]:
    """The first ``n`` samples with contrasts as rows of :data:`TABLE_COLUMNS`: the hardest contrast
    (k = 1) and, per task, whether the model was consistent at k = 1 (localization ranks only
    contrasts with a ``mutex_detection``)."""
    rows = []
    for row in result.per_sample:
        if len(rows) >= n:
            break
        caps = row["nll"]["caption"]
        if len(caps) < 2:
            continue
        j = min(range(len(caps) - 1), key=lambda c: (caps[1 + c], c))  # hardest contrast by caption NLL
        s = samples[row["index"]]

        def pair(task):
            v = row["nll"][task]
            return None if v is None else [v[0], v[1 + j]]

        consistent = {t: (row[t]["consistent"][0] if t in row and row[t]["consistent"] else None) for t in TASKS}
        rows.append([s.load_image(), s.id, row["caption"], row["contrast_captions"][j], row["answer"],
                     row["contrast_answers"][j], pair("caption"), pair("vqa"), pair("t2i"),
                     consistent["vqa"], consistent["localization"], consistent["t2i"]])
    return rows


def _json_default(x):
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
