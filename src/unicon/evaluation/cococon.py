"""CocoCon cross-task consistency evaluation (Maharana et al., sections 3 and 4.3).

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
with the cross-entropy loss, section 6). Gold and contrast texts are normalised identically
(lower-cased, whitespace collapsed) before scoring. The public reference code lower-cases only
the contrast captions, which makes gold and contrast captions differ in case and biases the
comparison; we do not copy that. When a
sample has several gold ``boxes`` the first one is the fixed localization output (the output
must be the same for gold and contrast inputs); ``locate()`` accuracy accepts any gold box.

Metrics (per task t in vqa, localization, t2i, anchor t_0 = caption)
----------------------------------------------------------------
Contrast sets of a sample are ranked by the captioning likelihood of their contrast caption,
most likely first (k = 1 is the hardest). For the k-th contrast (Eq. 1, strict inequalities,
written with NLLs ``s``; lower NLL = higher likelihood f)::

    C(i, k) = 1  if s_0(y) < s_0(y~k) and s_t(y) < s_t(y~k)      (gold preferred in both)
              1  if s_0(y) > s_0(y~k) and s_t(y) > s_t(y~k)      (contrast preferred in both)
              0  otherwise                                        (includes ties, counted)

    C_k = 100 / N_k * sum_i C(i, k)                                              (Eq. 2)

where N_k (reported as ``n_k``) is the number of samples with at least k contrast sets for
task t (localization: contrast sets that carry a ``mutex_detection``; those are ranked among
themselves). ``rho`` is the mean over samples of Spearman's rank correlation between the
caption NLLs and the task NLLs over [gold, contrast_1, ..., contrast_K]; a sample whose vector
is constant (or shorter than 2) has no defined correlation: it is excluded and counted in
``rho_undefined``. ``acc@k`` is the ranking accuracy of task t alone: % of samples with
s_t(y) < s_t(y~k) (ties are errors). Generative accuracies: CIDEr of ``caption()`` (x100,
pycocoevalcap), VQA normalised exact match (and VQAv2 soft accuracy when 10 answers exist),
``locate()`` accuracy at IoU >= 0.5, T2I exact scene match on ShapesWorld (the generated image
is parsed back and must satisfy the gold caption) and FID (torchmetrics) when local Inception
weights are given, otherwise ``"unavailable"``.

Probed concepts (``probe_words``, issue 17's knowledge gap): the samples whose gold answer names
one of the words (as a word, or with a plural ``s``/``es``) -- the samples about the concept, whose
gold caption states it and whose contrasts replace it -- are also aggregated on their own, under
``results["probe"]`` / ``cococon/probe/...``: the probe's caption ranking accuracy
``cococon/probe/caption/acc@1`` shows whether captioning knows the concept, its ``C_1`` whether
the tasks agree about it.

Spearman is computed on NLLs; negating both vectors (likelihoods) gives the same value.
``tasks`` restricts the compared tasks (T2I needs an image tokenizer that can encode the images,
e.g. not the ShapesWorld tokenizer on COCO photos). Candidates the model truncated to its maximum
length are counted in ``truncated_candidates``: truncation can make gold and contrast identical
and so produce ties.

Distributed evaluation: :class:`CocoConMetric` is a torchmetrics ``Metric`` with ``cat`` states
keyed by the sample's file index; after the sync, duplicates (DistributedSampler padding) are
dropped and rows sorted, so N ranks give exactly the single-process numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torchmetrics import Metric

from unicon.data.cococon import CocoConData, CocoConSample, load_cococon
from unicon.config import CocoConEvalConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.cli_common import add_common_args, check_common_args, load_model_for
from unicon.evaluation.callbacks import EvalCallback, log_eval_config, log_figures, log_metrics, log_table

log = logging.getLogger(__name__)

TASKS = ("vqa", "localization", "t2i")
SCORED = ("caption",) + TASKS
GENERATED_STATES = ("vqa_match", "vqa_soft", "loc_iou", "t2i_match")  # per-sample generative outcomes
TEXT_BYTES = 256  # width of the byte tensors that carry generated texts through the DDP sync


# ---------------------------------------------------------------------------------------------
# Text normalisation and generative accuracies
# ---------------------------------------------------------------------------------------------
def normalize_text(text: str) -> str:
    """Case/whitespace normalisation applied to gold *and* contrast texts before scoring."""
    return " ".join(text.strip().lower().split())


_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten".split())}
_ARTICLES = {"a", "an", "the"}
_PUNCT = re.compile(r"[^\w\s']|(?<!\w)'|'(?!\w)")


def normalize_answer(text: str) -> str:
    """VQA answer normalisation: lower case, no punctuation or articles, number words as digits."""
    text = _PUNCT.sub(" ", text.lower().replace("\n", " "))
    words = [_NUMBERS.get(w, w) for w in text.split() if w not in _ARTICLES]
    return " ".join(words)


def vqa_soft_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """VQAv2 accuracy: mean over the 10 leave-one-out subsets of min(1, #matches / 3)."""
    pred = normalize_answer(prediction)
    gts = [normalize_answer(a) for a in answers]
    accs = []
    for i in range(len(gts)):
        matches = sum(g == pred for j, g in enumerate(gts) if j != i)
        accs.append(min(1.0, matches / 3.0))
    return float(np.mean(accs))


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two ``[x, y, w, h]`` boxes (0 when either is empty)."""
    ax2, ay2, bx2, by2 = a[0] + a[2], a[1] + a[3], b[0] + b[2], b[1] + b[3]
    iw = max(0.0, min(ax2, bx2) - max(a[0], b[0]))
    ih = max(0.0, min(ay2, by2) - max(a[1], b[1]))
    inter = iw * ih
    union = max(a[2], 0) * max(a[3], 0) + max(b[2], 0) * max(b[3], 0) - inter
    return float(inter / union) if union > 0 else 0.0


def _simple_tokenize(text: str) -> str:
    """Pure-python stand-in for the PTB tokenizer: lower case, punctuation dropped."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def cider_score(references: dict[int, list[str]], candidates: dict[int, str],
                tokenizer: str = "auto") -> tuple[float, str]:
    """Corpus CIDEr-D (x100) with pycocoevalcap's ``Cider``; returns (score, tokenizer used).

    ``tokenizer``: ``ptb`` (Stanford PTB tokenizer, needs ``java``), ``simple`` (pure python) or
    ``auto`` (PTB when ``java`` is on the PATH).
    """
    from pycocoevalcap.cider.cider import Cider

    if not candidates:
        return float("nan"), tokenizer
    if tokenizer == "auto":
        tokenizer = "ptb" if shutil.which("java") else "simple"
    keys = sorted(candidates)
    if tokenizer == "ptb":
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        ptb = PTBTokenizer()
        gts = ptb.tokenize({k: [{"caption": r} for r in references[k]] for k in keys})
        res = ptb.tokenize({k: [{"caption": candidates[k]}] for k in keys})
    elif tokenizer == "simple":
        gts = {k: [_simple_tokenize(r) for r in references[k]] for k in keys}
        res = {k: [_simple_tokenize(candidates[k])] for k in keys}
    else:
        raise ValueError(f"tokenizer must be auto, ptb or simple, got {tokenizer!r}")
    score, _ = Cider().compute_score(gts, res)
    return 100.0 * float(score), tokenizer


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


def _encode_texts(texts: Sequence[str], device) -> torch.Tensor:
    out = torch.zeros(len(texts), TEXT_BYTES, dtype=torch.uint8, device=device)
    for i, t in enumerate(texts):
        raw = t.encode("utf-8")[:TEXT_BYTES]
        out[i, : len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return out


def _decode_texts(t: torch.Tensor) -> list[str]:
    return [bytes(row[row != 0].tolist()).decode("utf-8", errors="ignore") for row in t.cpu()]


# ---------------------------------------------------------------------------------------------
# Distributed accumulation
# ---------------------------------------------------------------------------------------------
class CocoConMetric(Metric):
    """Accumulates per-sample NLL rows and generative outcomes; syncs by concatenation.

    ``compute()`` returns the synced states with duplicate sample indices dropped (first kept)
    and rows sorted by index -- the input of :func:`consistency_metrics`. ``truncated_<task>``
    counts truncated candidates per scoring call (``Scores`` has no per-sample count), so it is
    exact with :func:`evaluate_model`'s unpadded sharding but would include padding repeats.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.add_state("index", default=[], dist_reduce_fx="cat")
        for task in SCORED:
            self.add_state(f"nll_{task}", default=[], dist_reduce_fx="cat")
            self.add_state(f"truncated_{task}", default=torch.tensor(0), dist_reduce_fx="sum")
        for name in GENERATED_STATES:
            self.add_state(name, default=[], dist_reduce_fx="cat")
        self.add_state("gen_caption", default=[], dist_reduce_fx="cat")
        self.add_state("gen_answer", default=[], dist_reduce_fx="cat")

    def update(self, index: torch.Tensor, nll: dict[str, torch.Tensor], generated: dict[str, Any] | None = None,
               truncated: dict[str, int] | None = None) -> None:
        B = index.shape[0]
        for task, n in (truncated or {}).items():
            setattr(self, f"truncated_{task}", getattr(self, f"truncated_{task}") + n)
        self.index.append(index.to(self.device, torch.long))
        for task in SCORED:
            if nll[task].shape != (B, self.width):
                raise ValueError(f"nll[{task!r}] has shape {tuple(nll[task].shape)}, expected {(B, self.width)}")
            getattr(self, f"nll_{task}").append(nll[task].to(self.device, torch.float64))
        generated = generated or {}
        for name in GENERATED_STATES:
            values = generated.get(name, [float("nan")] * B)
            getattr(self, name).append(torch.tensor(values, dtype=torch.float64, device=self.device))
        self.gen_caption.append(_encode_texts(generated.get("caption", [""] * B), self.device))
        self.gen_answer.append(_encode_texts(generated.get("answer", [""] * B), self.device))

    def compute(self) -> dict[str, torch.Tensor]:
        def cat(x):
            return torch.cat(x) if isinstance(x, list) else x

        index = cat(self.index)
        if index.numel() == 0:
            raise ValueError("CocoConMetric.compute() called before any update")
        order = torch.argsort(index, stable=True)
        sorted_idx = index[order]
        keep = torch.ones_like(sorted_idx, dtype=torch.bool)
        keep[1:] = sorted_idx[1:] != sorted_idx[:-1]
        sel = order[keep]
        out = {"index": index[sel], "truncated": {t: int(getattr(self, f"truncated_{t}")) for t in SCORED}}
        names = [f"nll_{t}" for t in SCORED] + list(GENERATED_STATES) + ["gen_caption", "gen_answer"]
        for name in names:
            out[name] = cat(getattr(self, name))[sel]
        return out


# ---------------------------------------------------------------------------------------------
# Eq. 1 / Eq. 2 and rho_rank from per-sample NLL rows
# ---------------------------------------------------------------------------------------------
def average_ranks(values: Sequence[float]) -> np.ndarray:
    """1-based ranks with tied values sharing their mean rank (as ``scipy.stats.rankdata``)."""
    v = np.asarray(values, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    s = v[order]
    group = np.cumsum(np.concatenate([[True], s[1:] != s[:-1]])) - 1
    counts = np.bincount(group)
    ranks = np.empty_like(v)
    ranks[order] = (np.cumsum(counts) - (counts - 1) / 2.0)[group]
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rho = Pearson correlation of average ranks; ``None`` when either side is constant."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else None


def contrast_order(caption_nll: Sequence[float], valid: Sequence[int]) -> list[int]:
    """Contrast positions (1-based columns) in ``valid`` sorted most-likely caption first (stable)."""
    return sorted(valid, key=lambda j: (caption_nll[j], j))


def sample_consistency(caption_nll: Sequence[float], task_nll: Sequence[float], max_k: int) -> dict:
    """Eq. 1 at each k and Spearman rho for one sample (NaN entries = absent contrasts)."""
    valid = [j for j in range(1, len(caption_nll))
             if not (math.isnan(caption_nll[j]) or math.isnan(task_nll[j]))]
    if math.isnan(task_nll[0]) or math.isnan(caption_nll[0]):
        valid = []
    order = contrast_order(caption_nll, valid)
    c0, t0 = caption_nll[0], task_nll[0]
    consistent, tie, task_acc, caption_acc = [], [], [], []
    for j in order[:max_k]:
        cj, tj = caption_nll[j], task_nll[j]
        consistent.append(bool((c0 < cj and t0 < tj) or (c0 > cj and t0 > tj)))
        tie.append(bool(c0 == cj or t0 == tj))
        task_acc.append(bool(t0 < tj))
        caption_acc.append(bool(c0 < cj))
    rho = None
    if valid:
        x = [c0] + [caption_nll[j] for j in valid]
        y = [t0] + [task_nll[j] for j in valid]
        rho = spearman(x, y)
    return {"order": [j - 1 for j in order], "consistent": consistent, "tie": tie,
            "task_acc": task_acc, "caption_acc": caption_acc, "rho": rho, "num_contrasts": len(valid)}


def _pct(values: list[bool]) -> float:
    return 100.0 * float(np.mean(values)) if values else float("nan")


def aggregate(per_sample: list[dict], max_k: int) -> dict:
    """C_k, n_k, ties_k, acc@k (task and caption) and rho over ``sample_consistency`` outputs."""
    res: dict[str, Any] = {"C_k": {}, "n_k": {}, "ties_k": {}, "acc@k": {}, "caption_acc@k": {}}
    for k in range(1, max_k + 1):
        rows = [r for r in per_sample if len(r["consistent"]) >= k]
        res["C_k"][k] = _pct([r["consistent"][k - 1] for r in rows])
        res["n_k"][k] = len(rows)
        res["ties_k"][k] = sum(r["tie"][k - 1] for r in rows)
        res["acc@k"][k] = _pct([r["task_acc"][k - 1] for r in rows])
        res["caption_acc@k"][k] = _pct([r["caption_acc"][k - 1] for r in rows])
    rhos = [r["rho"] for r in per_sample if r["rho"] is not None]
    res["rho"] = float(np.mean(rhos)) if rhos else float("nan")
    res["rho_n"] = len(rhos)
    res["rho_undefined"] = sum(1 for r in per_sample if r["rho"] is None and r["num_contrasts"] > 0)
    res["num_samples"] = sum(1 for r in per_sample if r["num_contrasts"] > 0)
    return res


def consistency_metrics(nll: dict[str, np.ndarray], categories: Sequence[str | None] | None = None, max_k: int = 5,
                        tasks: Sequence[str] = TASKS, probe: Sequence[bool] | None = None) -> tuple[dict, list[dict]]:
    """Metrics per task (and per category, and over the ``probe`` samples) from NLL arrays
    ``[N, 1 + K]`` (NaN = absent).

    Returns ``(results, per_sample)`` where ``per_sample[i][task]`` is :func:`sample_consistency`.
    """
    N = nll["caption"].shape[0]
    per_sample = [{t: sample_consistency(nll["caption"][i].tolist(), nll[t][i].tolist(), max_k) for t in tasks}
                  for i in range(N)]
    results = {t: aggregate([p[t] for p in per_sample], max_k) for t in tasks}
    if categories is not None and any(c is not None for c in categories):
        results["categories"] = {}
        for cat in sorted({c for c in categories if c is not None}):
            rows = [p for p, c in zip(per_sample, categories) if c == cat]
            results["categories"][cat] = {t: aggregate([p[t] for p in rows], max_k) for t in tasks}
    if probe is not None:
        rows = [p for p, flag in zip(per_sample, probe) if flag]
        results["probe"] = {"num_samples": len(rows), **{t: aggregate([p[t] for p in rows], max_k) for t in tasks}}
    return results, per_sample


def names_any(text: str, words: Sequence[str]) -> bool:
    """Does ``text`` name one of ``words`` (as a word, or with a plural ``s``/``es``)?"""
    return any(re.search(rf"\b{re.escape(w.lower())}(?:e?s)?\b", text.lower()) for w in words)


def probes(sample: CocoConSample, words: Sequence[str]) -> bool:
    """Is ``sample`` about a probed concept: does its gold answer name one of ``words``?"""
    return names_any(sample.answer, words)


# ---------------------------------------------------------------------------------------------
# The evaluator: batches -> metric states -> results
# ---------------------------------------------------------------------------------------------
@dataclass
class CocoConResult:
    results: dict  # nested metrics (written to results.json)
    per_sample: list[dict]  # one row per sample (written to per_sample.jsonl)

    def flat(self, prefix: str = "cococon") -> dict[str, float]:
        return flat_metrics(self.results, prefix)


class _ShapesChecker:
    """Exact T2I check on ShapesWorld: parse the generated image, test the gold caption on it."""

    def __init__(self, world_root: Path):
        from unicon.worlds import shapes

        self.shapes = shapes
        self.cfg = shapes.load_world(world_root).config

    def __call__(self, image, caption: str) -> float:
        try:
            scene = self.shapes.parse(image, self.cfg)
        except self.shapes.NotAShapesWorldImage:
            return 0.0
        return float(bool(self.shapes.caption_matches(caption, scene, self.cfg)))


class CocoConEvaluator:
    """Scores batches of samples with a model and accumulates them in a :class:`CocoConMetric`."""

    def __init__(self, samples: Sequence[CocoConSample], max_k: int = 5, generative: bool = True,
                 world_root: str | Path | None = None, fid_weights: str | None = None,
                 caption_prompt: str | None = None, cider_tokenizer: str = "auto", device=None,
                 tasks: Sequence[str] = TASKS, probe_words: Sequence[str] = ()):
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
        self.width = 1 + max((len(s.contrast_sets) for s in samples), default=0)
        self.metric = CocoConMetric(self.width)
        if device is not None:
            self.metric = self.metric.to(device)
        self.scene_checker = None
        is_world = world_root is not None and (Path(world_root) / "world.json").is_file()
        if generative and "t2i" in self.tasks and is_world:
            self.scene_checker = _ShapesChecker(Path(world_root))
        self.fid = None
        if generative and "t2i" in self.tasks and fid_weights:
            self.fid = _make_fid(fid_weights)
            if device is not None:
                self.fid = self.fid.to(device)

    @torch.no_grad()
    def update(self, model, samples: Sequence[CocoConSample]) -> None:
        images = [s.load_image() for s in samples]
        nll, truncated = score_samples(model, samples, images, self.width, self.caption_prompt, self.tasks)
        generated = self._generate(model, samples, images) if self.generative else None
        index = torch.tensor([s.index for s in samples], dtype=torch.long)
        self.metric.update(index, nll, generated, truncated)

    def _generate(self, model, samples, images) -> dict:
        B = len(samples)
        out: dict[str, Any] = {"caption": model.caption(images)}
        if "vqa" in self.tasks:
            out["answer"] = model.answer(images, [s.query for s in samples])
            out["vqa_match"] = [float(normalize_answer(a) == normalize_answer(s.answer))
                                for a, s in zip(out["answer"], samples)]
            out["vqa_soft"] = [vqa_soft_accuracy(a, s.answers) if s.answers and len(s.answers) == 10 else float("nan")
                               for a, s in zip(out["answer"], samples)]
        iou = [float("nan")] * B
        idx = [b for b, s in enumerate(samples) if s.has_localization] if "localization" in self.tasks else []
        if idx:
            boxes = model.locate([images[b] for b in idx], [samples[b].detection for b in idx])
            for b, box in zip(idx, boxes.tolist()):
                iou[b] = max(box_iou(box, g) for g in samples[b].boxes)
        out["loc_iou"] = iou
        match = [float("nan")] * B
        if self.scene_checker is not None or self.fid is not None:
            generated = model.generate_image([normalize_text(s.caption) for s in samples])
            if self.scene_checker is not None:
                match = [self.scene_checker(im, s.caption) for im, s in zip(generated, samples)]
            if self.fid is not None:
                from unicon.models.base import pil_to_tensor

                size = images[0].size
                self.fid.update(pil_to_tensor([im.resize(size) for im in images]).to(self.fid.device), real=True)
                self.fid.update(pil_to_tensor([im.resize(size) for im in generated]).to(self.fid.device), real=False)
        out["t2i_match"] = match
        return out

    def compute(self) -> CocoConResult:
        state = self.metric.compute()
        index = state["index"].cpu().tolist()
        nll = {t: state[f"nll_{t}"].cpu().numpy() for t in SCORED}
        samples = [self.samples[i] for i in index]
        probe = [probes(s, self.probe_words) for s in samples] if self.probe_words else None
        results, per_task = consistency_metrics(nll, [s.category for s in samples], self.max_k, self.tasks, probe)
        if probe is not None:
            results["probe"]["words"] = list(self.probe_words)
        results["num_samples"] = len(samples)
        results["max_k"] = self.max_k
        # candidates cut to the model's max length: their scores (and possible ties) are affected
        results["truncated_candidates"] = state["truncated"]
        gen_caption = _decode_texts(state["gen_caption"])
        gen_answer = _decode_texts(state["gen_answer"])
        gen = {name: state[name].cpu().numpy() for name in GENERATED_STATES}
        if self.generative:
            results["generative"] = self._generative_results(samples, gen_caption, gen)
        per_sample = []
        for i, s in enumerate(samples):
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
                p = per_task[i][t]
                row[t] = {"order": p["order"], "consistent": p["consistent"], "tie": p["tie"],
                          "acc": p["task_acc"], "rho": p["rho"]}
            if self.generative:
                row["generated"] = {
                    "caption": gen_caption[i], "answer": gen_answer[i],
                    **{k: (None if math.isnan(v[i]) else float(v[i])) for k, v in gen.items()},
                }
            per_sample.append(row)
        return CocoConResult(results, per_sample)

    def _generative_results(self, samples, gen_caption, gen) -> dict:
        def mean_pct(x):
            x = x[~np.isnan(x)]
            return 100.0 * float(x.mean()) if x.size else float("nan")

        refs = {i: s.references for i, s in enumerate(samples)}
        cands = {i: c for i, c in enumerate(gen_caption)}
        cider, tok = cider_score(refs, cands, self.cider_tokenizer)
        loc = gen["loc_iou"][~np.isnan(gen["loc_iou"])]
        out: dict[str, Any] = {"caption_cider": cider, "cider_tokenizer": tok}
        if "vqa" in self.tasks:
            out.update(vqa_accuracy=mean_pct(gen["vqa_match"]), vqa_soft_accuracy=mean_pct(gen["vqa_soft"]),
                       vqa_soft_n=int((~np.isnan(gen["vqa_soft"])).sum()))
        if "localization" in self.tasks:
            out["localization_acc@0.5"] = 100.0 * float((loc >= 0.5).mean()) if loc.size else float("nan")
            out["localization_mean_iou"] = float(loc.mean()) if loc.size else float("nan")
            out["localization_n"] = int(loc.size)
        if "t2i" in self.tasks:
            out["t2i_scene_match"] = mean_pct(gen["t2i_match"]) if self.scene_checker is not None else "unavailable"
            out["t2i_fid"] = float(self.fid.compute()) if self.fid is not None else "unavailable"
        return out


def _make_fid(weights: str):
    path = Path(weights)
    if not path.is_file():
        raise UserError(f"--fid-weights: no Inception weights file at {path}")
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance

        return FrechetInceptionDistance(feature=2048, normalize=True, feature_extractor_weights_path=str(path))
    except (ImportError, ModuleNotFoundError) as e:
        raise UserError(f"FID needs torchmetrics' Inception extractor (torch-fidelity): {e}") from None


def evaluate_model(model, samples: Sequence[CocoConSample], batch_size: int = 16, rank: int = 0, world_size: int = 1,
                   progress: bool = False, **evaluator_kwargs) -> CocoConResult:
    """Evaluate ``samples``; under DDP each rank takes ``samples[rank::world_size]`` (no padding)."""
    if not samples:
        raise ValueError("no CocoCon samples to evaluate")
    if world_size > len(samples):
        raise ValueError(f"{len(samples)} samples cannot be sharded over {world_size} ranks")
    device = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    ev = CocoConEvaluator(samples, device=device, **evaluator_kwargs)
    shard = list(samples)[rank::world_size]
    batches = [shard[i: i + batch_size] for i in range(0, len(shard), batch_size)]
    iterator: Iterable = batches
    if progress:
        from rich.progress import track

        iterator = track(batches, description="cococon")
    for batch in iterator:
        preemption.check()
        ev.update(model, batch)
    return ev.compute()


# ---------------------------------------------------------------------------------------------
# Reporting: flat scalars, files, plots, W&B table rows
# ---------------------------------------------------------------------------------------------
def evaluated_tasks(results: dict) -> list[str]:
    return [t for t in TASKS if t in results]


def flat_metrics(results: dict, prefix: str = "cococon") -> dict[str, float]:
    """``cococon/<task>/C_k``, ``n_k``, ``ties_k``, ``acc@k``, ``rho`` ... as logger scalars."""
    out: dict[str, float] = {}
    tasks = evaluated_tasks(results)
    for t in tasks:
        r = results[t]
        for k in r["C_k"]:
            out[f"{prefix}/{t}/C_{k}"] = r["C_k"][k]
            out[f"{prefix}/{t}/n_{k}"] = r["n_k"][k]
            out[f"{prefix}/{t}/ties_{k}"] = r["ties_k"][k]
            out[f"{prefix}/{t}/acc@{k}"] = r["acc@k"][k]
        out[f"{prefix}/{t}/rho"] = r["rho"]
        out[f"{prefix}/{t}/rho_undefined"] = r["rho_undefined"]
    for t, n in results.get("truncated_candidates", {}).items():
        out[f"{prefix}/{t}/truncated"] = n
    for k, v in results[tasks[0]]["caption_acc@k"].items():
        out[f"{prefix}/caption/acc@{k}"] = v
    for name, v in results.get("generative", {}).items():
        if isinstance(v, (int, float)):
            out[f"{prefix}/generative/{name}"] = v
    for cat, res in results.get("categories", {}).items():
        for t in tasks:
            out[f"{prefix}/category/{cat}/{t}/C_1"] = res[t]["C_k"][1]
    if "probe" in results:
        probe = results["probe"]
        out[f"{prefix}/probe/num_samples"] = probe["num_samples"]
        for t in tasks:
            out[f"{prefix}/probe/{t}/C_1"] = probe[t]["C_k"][1]
            out[f"{prefix}/probe/{t}/acc@1"] = probe[t]["acc@k"][1]
            out[f"{prefix}/probe/{t}/rho"] = probe[t]["rho"]
        out[f"{prefix}/probe/caption/acc@1"] = probe[tasks[0]]["caption_acc@k"][1]
    return out


def write_outputs(result: CocoConResult, out_dir: Path) -> None:
    """``results.json``, ``per_sample.jsonl`` and the two plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = json.dumps(_nan_to_none(result.results), indent=2, default=_json_default)
    (out_dir / "results.json").write_text(results + "\n")
    with (out_dir / "per_sample.jsonl").open("w") as f:
        for row in result.per_sample:
            f.write(json.dumps(_nan_to_none(row), default=_json_default) + "\n")
    plot_results(result.results, out_dir)


def _nan_to_none(x):
    """NaN (an undefined metric, e.g. C_k with n_k = 0) becomes JSON ``null``."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def plot_results(results: dict, out_dir: Path) -> None:
    """``consistency_by_k.png`` (Fig. 5a) and ``consistency_vs_accuracy.png`` (Fig. 5b, one point per k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"vqa": "tab:blue", "localization": "tab:red", "t2i": "tab:green"}
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    for t in evaluated_tasks(results):
        ks = [k for k, n in results[t]["n_k"].items() if n > 0]
        ax.plot(ks, [results[t]["C_k"][k] for k in ks], "o-", color=colors[t], label=t)
    ax.set_xlabel("difficulty k (1 = hardest contrast)")
    ax.set_ylabel("% consistency C_k")
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "consistency_by_k.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 100], [0, 100], "k--", lw=0.8)
    for t in evaluated_tasks(results):
        ks = [k for k, n in results[t]["n_k"].items() if n > 0]
        xs = [results[t]["acc@k"][k] for k in ks]
        ys = [results[t]["C_k"][k] for k in ks]
        ax.plot(xs, ys, "o-", color=colors[t], lw=0.8, label=t)
        for k, x, y in zip(ks, xs, ys):
            ax.annotate(f"k={k}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("% ranking accuracy@k (task alone)")
    ax.set_ylabel("% consistency C_k")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "consistency_vs_accuracy.png", dpi=120)
    plt.close(fig)


TABLE_COLUMNS = ["image", "id", "caption", "hardest_contrast", "answer", "contrast_answer",
                 "caption_nll", "vqa_nll", "t2i_nll", "vqa_consistent", "localization_consistent", "t2i_consistent"]
#: the plots of :func:`plot_results`, logged as ``cococon/fig/<name>`` (``log_figures``)
FIGURES = ("consistency_by_k", "consistency_vs_accuracy")


def table_rows(result: CocoConResult, samples: dict[int, CocoConSample], n: int) -> list[list]:
    """A few per-sample rows for the W&B table: the hardest contrast (k=1) and, per task, whether
    the model was consistent at k=1 (localization ranks only contrasts with a ``mutex_detection``)."""
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


# ---------------------------------------------------------------------------------------------
# Epoch-end callback
# ---------------------------------------------------------------------------------------------
class CocoConCallback(EvalCallback):
    """Runs CocoCon on a fixed subset at the end of every ``every_n_epochs``-th epoch."""

    name = "cococon"

    def __init__(self, data: str | Path, images_root: str | Path | None = None, max_samples: int | None = 200,
                 batch_size: int = 16, generative: bool = True, table_rows: int = 16, skip_missing: bool = False,
                 tasks: Sequence[str] = TASKS, every_n_epochs: int = 1, fail_on_error: bool = False,
                 probe_words: Sequence[str] = ()):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        self.probe_words = tuple(probe_words)
        self.data_path = Path(data)
        self.images_root = images_root
        self.max_samples = max_samples
        self.batch_size = batch_size
        self.generative = generative
        self.table_rows = table_rows
        self.skip_missing = skip_missing
        self.tasks = tuple(tasks)
        self._data: CocoConData | None = None

    @classmethod
    def from_config(cls, cfg) -> "CocoConCallback":
        """From a RunConfig: ``eval.cococon`` with defaults ``<data.root>/cococon_test.json``."""
        c = cfg.eval.cococon
        data = c.data or str(Path(cfg.data.root) / "cococon_test.json")
        return cls(data=data, images_root=c.images_root, max_samples=c.max_samples, batch_size=c.batch_size,
                   generative=c.generative, table_rows=c.table_rows, skip_missing=c.skip_missing, tasks=list(c.tasks),
                   every_n_epochs=c.every_n_epochs, fail_on_error=cfg.eval.fail_on_error,
                   probe_words=list(c.probe_words))

    def dataset(self) -> CocoConData:
        if self._data is None:
            self._data = load_cococon(self.data_path, self.images_root, self.skip_missing).subset(self.max_samples)
        return self._data

    def evaluate(self, trainer, model) -> dict[str, float]:
        data = self.dataset()
        result = evaluate_model(model, data.samples, self.batch_size, rank=trainer.global_rank,
                                world_size=trainer.world_size, generative=self.generative,
                                world_root=data.images_root, tasks=self.tasks, probe_words=self.probe_words)
        if trainer.is_global_zero:
            out = self.output_dir(trainer)
            write_outputs(result, out)
            log_figures(trainer.loggers, "cococon", out, FIGURES, step=trainer.global_step)
            if self.table_rows:
                rows = table_rows(result, {s.index: s for s in data.samples}, self.table_rows)
                log_table(trainer.loggers, "cococon/samples", TABLE_COLUMNS, rows, step=trainer.global_step)
        return result.flat()


# ---------------------------------------------------------------------------------------------
# `unicon evaluate cococon`
# ---------------------------------------------------------------------------------------------
def check_can_score_t2i(model, sample: CocoConSample) -> None:
    """Score one sample's text-to-image likelihood before the run: a model whose image tokenizer
    cannot encode these images (the ShapesWorld model on COCO photos) fails here, in seconds."""
    try:
        with torch.no_grad():
            model.score_image([[sample.caption]], [sample.load_image()])
    except UserError:
        raise
    except Exception as e:  # the backend's own complaint, whatever its type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the model cannot score text-to-image on {sample.file_name} ({first}); evaluate the other "
                        "tasks with --tasks vqa localization") from None


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unicon evaluate cococon",
                                     description="CocoCon cross-task consistency (C_k, rho) and task accuracies.")
    add_common_args(parser, out_help="output folder (results.json, per_sample.jsonl, plots)")
    parser.add_argument("--data", required=True, help="CocoCon-schema JSON file")
    parser.add_argument("--images", default=None, help="image root for file_name (default: the JSON's folder)")
    parser.add_argument("--skip-missing", action="store_true", help="skip samples whose image file is missing")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=CocoConEvalConfig.batch_size)
    parser.add_argument("--max-k", type=int, default=5)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS),
                        help="tasks compared with captioning (t2i needs an image tokenizer that encodes the images)")
    parser.add_argument("--no-generative", action="store_true", help="only likelihood scoring (no CIDEr/acc/FID)")
    parser.add_argument("--probe-words", nargs="+", default=[], metavar="WORD",
                        help="also report the samples whose gold answer names one of these words "
                             "(results.json 'probe'; e.g. a ShapesWorld --caption-gap concept)")
    parser.add_argument("--fid-weights", default=None, help="local Inception weights for FID (else 'unavailable')")
    parser.add_argument("--cider-tokenizer", choices=["auto", "ptb", "simple"], default="auto")
    parser.add_argument("--table-rows", type=int, default=CocoConEvalConfig.table_rows, help="samples in the W&B table")
    parser.add_argument("--name", default=None, help="run name for the logger")
    args = parser.parse_args(argv)
    out = check_common_args(args, ("batch_size", "max_samples", "max_k", "table_rows"), {"table_rows": 0})

    from unicon.config import LoggerConfig
    from unicon.models import weights_fingerprint
    from unicon.training.loggers import make_loggers

    data = load_cococon(args.data, args.images, args.skip_missing).subset(args.max_samples)
    log.info(data.report.summary())
    if not data.samples:
        raise UserError(f"{args.data}: no sample left to evaluate ({data.report.summary()})")
    model = load_model_for(args)
    if "t2i" in args.tasks:
        check_can_score_t2i(model, data.samples[0])
    start = time.perf_counter()
    with preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch, exit 128 + signal
        result = evaluate_model(model, data.samples, args.batch_size, progress=True, max_k=args.max_k,
                                generative=not args.no_generative, world_root=data.images_root,
                                fid_weights=args.fid_weights, cider_tokenizer=args.cider_tokenizer, tasks=args.tasks,
                                probe_words=args.probe_words)
    seconds = time.perf_counter() - start
    result.results.update(
        data=str(args.data), ckpt=str(args.ckpt), checkpoint=str(Path(args.ckpt).resolve()),
        model_fingerprint=weights_fingerprint(model), seconds=seconds,
        num_samples_in_file=data.report.num_annotations,
        skipped_missing_images=len(data.report.missing_images),
        load_report={k: (len(v) if isinstance(v, list) else v) for k, v in data.report.to_dict().items()},
    )
    write_outputs(result, out)
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=args.name or f"cococon-{Path(args.ckpt).name}")
    log_eval_config(loggers, args, result.results["model_fingerprint"])
    metrics = result.flat()
    metrics["cococon/seconds"] = seconds
    log_metrics(loggers, metrics, step=0)
    log_figures(loggers, "cococon", out, FIGURES, step=0)
    rows = table_rows(result, {s.index: s for s in data.samples}, args.table_rows)
    log_table(loggers, "cococon/samples", TABLE_COLUMNS, rows, step=0)
    for lg in loggers:
        lg.finalize("success")
    r = result.results
    print(f"cococon: {r['num_samples']} samples in {seconds:.1f}s -> {out}")
    for t in evaluated_tasks(r):
        print(f"  {t:12s} C_1={r[t]['C_k'][1]:.1f} (n={r[t]['n_k'][1]}, ties={r[t]['ties_k'][1]}) "
              f"rho={r[t]['rho']:.3f} (undefined {r[t]['rho_undefined']}) acc@1={r[t]['acc@k'][1]:.1f}")
    return 0
