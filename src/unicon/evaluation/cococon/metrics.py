"""CocoCon metrics (Maharana et al., section 3): pure functions of NLLs and generated outputs.

No model calls and no file I/O here (those are :mod:`.runner`'s; the one exception is
pycocoevalcap's PTB tokenizer, which :func:`cider_score` may run through ``java``). Scores are NLLs ``s`` (lower =
more likely, ``s = -log f_theta``); every row is ``[gold, contrast_1, ..., contrast_K]`` with NaN
where a contrast is absent for that task.

Consistency of one sample at its k-th contrast (Eq. 1, strict inequalities, anchor task t_0 =
captioning, compared task t)::

    C(i, k) = 1  if s_0(y) < s_0(y~k) and s_t(y) < s_t(y~k)      (gold preferred in both)
              1  if s_0(y) > s_0(y~k) and s_t(y) > s_t(y~k)      (contrast preferred in both)
              0  otherwise                                        (ties included, and counted)

The contrasts of a sample are ranked by their caption NLL, most likely first (k = 1 is the
hardest contrast). Over the samples (Eq. 2)::

    C_k = 100 / N_k * sum_i C(i, k)

where N_k (``n_k``) counts the samples with at least k contrasts for task t. Eq. 2 writes 1/N
for a dataset with K contrasts per sample; CocoCon samples have 1 to 5, so a sample enters C_k
only for the k it has (as the public reference code's ``support_by_top_k`` does). Localization
ranks only the contrasts that carry a ``mutex_detection``.

ρ_rank (``rho``; section 3 names it, without an equation number) is the mean over samples of
Spearman's rank correlation between the caption NLLs and the task NLLs over
``[gold, contrast_1, ..., contrast_K]``::

    rho_i = Pearson(R(s_0), R(s_t)),   R = average ranks (ties share their mean rank)
    rho   = 1 / |D| * sum_{i in D} rho_i

A constant row (every caption NLL, or every task NLL, equal) has no defined correlation: it is
left out of D and counted in ``rho_undefined``. Negating both rows (likelihoods instead of NLLs)
leaves rho unchanged.

``acc@k`` is the ranking accuracy of task t alone, ``100 * mean_i 1[s_t(y) < s_t(y~k)]`` (ties
are errors), and ``caption_acc@k`` the same for captioning.

Where the paper and the public reference code (``adymaharana/cococon``,
``evaluate_contrast_all_tasks.py``) disagree we follow the paper:

* the reference counts only strictly opposite preferences as inconsistent, so a tie counts as
  consistent; Eq. 1's "otherwise" makes it inconsistent (and we report ``ties_k``);
* the reference averages ``spearmanr(...).correlation`` with ``np.mean``, so one constant row
  turns ρ_rank into NaN; we leave such rows out and count them;
* the reference lower-cases the contrast captions but not the gold one before scoring, which
  biases the comparison (:func:`unicon.evaluation.cococon.runner.normalize_text` treats both alike).

Where the paper is silent we follow the reference: ``s`` is the per-token mean NLL
(``Scores.nll``; the reference's ``average_loss=True``), where Eq. 1 writes the likelihood
``f_θ(y|x)`` without saying whether it is normalised by length. The two differ only where a sample's
candidates differ in length: then the mean favours the longer candidate when its extra tokens are
easy. ShapesWorld's location contrasts are such a case ("above" is one token, "to the left of"
four): there the mean ranks the gold caption first less often than the sum does (25.7% against
37.1%, one validation-split run; docs/notebook/2026-12-03-where-t2i-loses-consistency.md).

Generative accuracies: corpus CIDEr-D of the generated captions (:func:`cider_score`), VQA exact
match and VQAv2 soft accuracy after :func:`normalize_answer`, localization accuracy at IoU >= 0.5
(:func:`box_iou`), T2I scene match (ShapesWorld) and FID (torchmetrics, in the runner).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from scipy.stats import rankdata
from torchvision.ops import box_convert
from torchvision.ops import box_iou as box_iou_matrix

from unicon.config import COCOCON_MAX_K, EVAL_TASKS

TASKS = EVAL_TASKS  # the tasks t compared with the anchor t_0 = captioning
SCORED = ("caption",) + TASKS
GENERATED = ("vqa_match", "vqa_soft", "loc_iou", "t2i_match")  # per-sample generative outcomes
MAX_K = COCOCON_MAX_K  # the largest difficulty k reported (CocoCon samples have at most 5 contrast sets)


# ---------------------------------------------------------------------------------------------
# Generative accuracies
# ---------------------------------------------------------------------------------------------
_NUMBERS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
_ARTICLES = {"a", "an", "the"}
_PUNCT = re.compile(r"[^\w\s']|(?<!\w)'|'(?!\w)")


def normalize_answer(text: str) -> str:
    """The answer normalisation of every VQA comparison (CocoCon VQA, ShapesWorld VQA accuracy).

    Rules, in order: lower case; newlines as spaces; every punctuation character, and every
    apostrophe not inside a word, becomes a space; whitespace collapsed; the articles ``a``,
    ``an``, ``the`` dropped; the number words ``zero`` .. ``ten`` written as digits. So
    ``"The two dogs."`` becomes ``"2 dogs"`` and ``"don't"`` keeps its apostrophe.

    This follows VQAv2's official normalisation (``vqaEval.py``: ``processPunctuation`` then
    ``processDigitArticle``) in its effect on answers, and simplifies it where both sides of a
    comparison are normalised alike anyway: punctuation always becomes a space (the official code
    sometimes deletes it, and keeps the point of ``3.5``), and there is no contraction table and
    no ``none`` -> ``0``.
    """
    text = _PUNCT.sub(" ", text.lower().replace("\n", " "))
    return " ".join(_NUMBERS.get(w, w) for w in text.split() if w not in _ARTICLES)


def vqa_soft_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """VQAv2 accuracy of one prediction against its annotators' answers (10 in VQAv2)::

        acc = 1 / n * sum_{i=1..n} min(1, #{j != i : a_j == p} / 3)

    the mean over the n leave-one-out subsets, after :func:`normalize_answer` on every side.
    """
    pred = normalize_answer(prediction)
    gts = [normalize_answer(a) for a in answers]
    accs = [min(1.0, sum(g == pred for j, g in enumerate(gts) if j != i) / 3.0) for i in range(len(gts))]
    return float(np.mean(accs))


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """``IoU = |A ∩ B| / |A ∪ B|`` of two ``[x, y, w, h]`` boxes (``torchvision.ops.box_iou``).

    A box with ``w <= 0`` or ``h <= 0`` (e.g. an inverted predicted box) is empty: its IoU with
    anything is 0.0, also when both boxes are empty (where torchvision gives 0 / 0).
    """
    boxes = torch.tensor([list(a), list(b)], dtype=torch.float64)
    boxes[:, 2:] = boxes[:, 2:].clamp(min=0)
    xyxy = box_convert(boxes, "xywh", "xyxy")
    return float(box_iou_matrix(xyxy[:1], xyxy[1:]).nan_to_num(0.0))


def _simple_tokenize(text: str) -> str:
    """Pure-python stand-in for the PTB tokenizer: lower case, punctuation dropped."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


@contextlib.contextmanager
def _java_speed_report_dropped():
    """Stanford's PTB tokenizer, a java process writing to this process's stderr, reports its speed
    there on every call ("PTBTokenizer tokenized 2270 tokens at ... tokens per second."): that line
    is dropped, anything else it writes is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines()
            rest = [line for line in lines if not line.startswith("PTBTokenizer tokenized ")]
            if rest:
                print("\n".join(rest), file=sys.stderr, flush=True)


def tokenize_captions(references: Mapping[Any, Sequence[str]], candidates: Mapping[Any, str],
                      tokenizer: str = "auto") -> tuple[dict, dict, str]:
    """``(references, candidates, tokenizer used)`` tokenised as pycocoevalcap's scorers take them
    (``{key: [text, ...]}``, keys in the order of ``candidates``). ``tokenizer``: ``ptb`` (Stanford PTB
    tokenizer, needs ``java``), ``simple`` (pure python: lower case, punctuation dropped) or ``auto``
    (PTB when ``java`` is on the PATH)."""
    if tokenizer == "auto":
        tokenizer = "ptb" if shutil.which("java") else "simple"
    keys = list(candidates)
    if tokenizer == "ptb":
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        ptb = PTBTokenizer()
        with _java_speed_report_dropped():
            gts = ptb.tokenize({k: [{"caption": r} for r in references[k]] for k in keys})
            res = ptb.tokenize({k: [{"caption": candidates[k]}] for k in keys})
    elif tokenizer == "simple":
        gts = {k: [_simple_tokenize(r) for r in references[k]] for k in keys}
        res = {k: [_simple_tokenize(candidates[k])] for k in keys}
    else:
        raise ValueError(f"tokenizer must be auto, ptb or simple, got {tokenizer!r}")
    return gts, res, tokenizer


def cider_score(references: dict[int, list[str]], candidates: dict[int, str],
                tokenizer: str = "auto") -> tuple[float, str]:
    """Corpus CIDEr-D x 100 (pycocoevalcap's ``Cider``, Vedantam et al.) of the candidates tokenised by
    :func:`tokenize_captions`; returns (score, tokenizer used)."""
    from pycocoevalcap.cider.cider import Cider

    if not candidates:
        return float("nan"), tokenizer
    gts, res, tokenizer = tokenize_captions(references, {k: candidates[k] for k in sorted(candidates)}, tokenizer)
    score, _ = Cider().compute_score(gts, res)
    return 100.0 * float(score), tokenizer


def _mean_pct(x: np.ndarray) -> float:
    """100 * the mean of the non-NaN entries (NaN when there are none)."""
    x = x[~np.isnan(x)]
    return 100.0 * float(x.mean()) if x.size else float("nan")


def generative_metrics(references: Sequence[list[str]], captions: Sequence[str], outcomes: dict[str, np.ndarray],
                       tasks: Sequence[str], scene_checked: bool, cider_tokenizer: str = "auto") -> dict[str, Any]:
    """Task accuracies over the samples, from their generated captions and per-sample ``outcomes``
    (:data:`GENERATED`, NaN where not measured): ``caption_cider``; ``vqa_accuracy`` (% exact
    matches) and ``vqa_soft_accuracy`` (% over the ``vqa_soft_n`` samples with 10 answers);
    ``localization_acc@0.5`` (% with IoU >= 0.5) and ``localization_mean_iou``; ``t2i_scene_match``
    (% of generated images that satisfy the gold caption; ``"unavailable"`` unless ``scene_checked``)."""
    cider, tok = cider_score(dict(enumerate(references)), dict(enumerate(captions)), cider_tokenizer)
    out: dict[str, Any] = {"caption_cider": cider, "cider_tokenizer": tok}
    if "vqa" in tasks:
        out.update(vqa_accuracy=_mean_pct(outcomes["vqa_match"]), vqa_soft_accuracy=_mean_pct(outcomes["vqa_soft"]),
                   vqa_soft_n=int((~np.isnan(outcomes["vqa_soft"])).sum()))
    if "localization" in tasks:
        loc = outcomes["loc_iou"][~np.isnan(outcomes["loc_iou"])]
        out["localization_acc@0.5"] = 100.0 * float((loc >= 0.5).mean()) if loc.size else float("nan")
        out["localization_mean_iou"] = float(loc.mean()) if loc.size else float("nan")
        out["localization_n"] = int(loc.size)
    if "t2i" in tasks:
        out["t2i_scene_match"] = _mean_pct(outcomes["t2i_match"]) if scene_checked else "unavailable"
    return out


# ---------------------------------------------------------------------------------------------
# Eq. 1, Eq. 2 and ρ_rank
# ---------------------------------------------------------------------------------------------
def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rho: the Pearson correlation of the average ranks (``scipy.stats.rankdata``,
    ties sharing their mean rank). ``None`` when ``x`` or ``y`` is constant (no defined correlation).

    The Pearson step is written out: ``scipy.stats.spearmanr`` gives the same value up to one ulp
    (``np.corrcoef`` rounds differently) and NaN with a warning on constant input.
    """
    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else None


def sample_consistency(caption_nll: Sequence[float], task_nll: Sequence[float], max_k: int) -> dict:
    """Eq. 1 at each k <= ``max_k`` and rho_i for one sample (NaN entries = absent contrasts).

    Returns ``order`` (contrast positions, 0-based, most likely caption first; ties keep file
    order), and per k: ``consistent`` (C(i, k)), ``tie`` (gold and contrast NLLs equal in either
    task), ``task_acc`` and ``caption_acc``; ``rho`` (None when undefined) and ``num_contrasts``.
    """
    valid = [j for j in range(1, len(caption_nll)) if not (math.isnan(caption_nll[j]) or math.isnan(task_nll[j]))]
    if math.isnan(task_nll[0]) or math.isnan(caption_nll[0]):
        valid = []
    order = sorted(valid, key=lambda j: (caption_nll[j], j))
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
        rho = spearman([c0] + [caption_nll[j] for j in valid], [t0] + [task_nll[j] for j in valid])
    return {"order": [j - 1 for j in order], "consistent": consistent, "tie": tie,
            "task_acc": task_acc, "caption_acc": caption_acc, "rho": rho, "num_contrasts": len(valid)}


def _pct(values: list[bool]) -> float:
    return 100.0 * float(np.mean(values)) if values else float("nan")


def aggregate(per_sample: list[dict], max_k: int) -> dict:
    """C_k (Eq. 2), n_k, ties_k, acc@k, caption_acc@k for k = 1..max_k, and rho, rho_n,
    rho_undefined, num_samples over :func:`sample_consistency` outputs (C_k is NaN when n_k = 0)."""
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


def consistency_metrics(nll: dict[str, np.ndarray], categories: Sequence[str | None] | None = None, max_k: int = MAX_K,
                        tasks: Sequence[str] = TASKS,
                        probe: dict[str, Sequence[bool]] | None = None) -> tuple[dict, list[dict]]:
    """:func:`aggregate` per task, per category, and over the probed samples, from NLL arrays
    ``[N, 1 + K]`` (NaN = absent). ``probe[word][i]``: sample i is about the probed concept ``word``;
    ``results["probe"]`` aggregates the samples about any of the words, and ``results["probe"]["by_word"]``
    each word's own (a world with one knowledge gap per task probes one concept per task). Returns
    ``(results, per_sample)`` where ``per_sample[i][task]`` is :func:`sample_consistency`."""
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
        def over(flags):
            rows = [p for p, flag in zip(per_sample, flags) if flag]
            return {"num_samples": len(rows), **{t: aggregate([p[t] for p in rows], max_k) for t in tasks}}

        results["probe"] = over([any(flags) for flags in zip(*probe.values())])
        results["probe"]["by_word"] = {word: over(flags) for word, flags in probe.items()}
    return results, per_sample


def names_any(text: str, words: Sequence[str]) -> bool:
    """Does ``text`` name one of ``words`` (as a word, or with a plural ``s``/``es``)? The probed
    samples of a knowledge-gap concept are those whose gold answer names it."""
    return any(re.search(rf"\b{re.escape(w.lower())}(?:e?s)?\b", text.lower()) for w in words)


# ---------------------------------------------------------------------------------------------
# Logger scalars
# ---------------------------------------------------------------------------------------------
def evaluated_tasks(results: dict) -> list[str]:
    return [t for t in TASKS if t in results]


def flat_metrics(results: dict, prefix: str = "cococon") -> dict[str, float]:
    """``<prefix>/<task>/C_k``, ``n_k``, ``ties_k``, ``acc@k``, ``rho`` ... as logger scalars."""
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
        groups = {"probe": results["probe"],
                  **{f"probe/{w}": r for w, r in results["probe"].get("by_word", {}).items()}}
        for name, probe in groups.items():
            out[f"{prefix}/{name}/num_samples"] = probe["num_samples"]
            for t in tasks:
                out[f"{prefix}/{name}/{t}/C_1"] = probe[t]["C_k"][1]
                out[f"{prefix}/{name}/{t}/acc@1"] = probe[t]["acc@k"][1]
                out[f"{prefix}/{name}/{t}/rho"] = probe[t]["rho"]
            out[f"{prefix}/{name}/caption/acc@1"] = probe[tasks[0]]["caption_acc@k"][1]
    return out
