"""UReason runs: the model's three settings over instances, judging, per-sample records and files.

Three settings per instance, all through :class:`unicon.models.base.UnifiedModel`:

1. **direct** -- ``I = M(P_direct)``: ``generate_image([direct_prompt])`` (eq. 1);
2. **reasoning-guided** -- ``R = M(P)`` with ``reason([prompt])``, then ``I = M([P, R])``:
   ``generate_image([prompt], context=[R])`` (eq. 2); an input too long for the model loses the
   beginning of ``R`` (``UnifiedModel.fit_context``; the words cut are ``context_words_cut``);
3. **de-contextualized** -- ``I = M(R_p)``: ``generate_image([R_p])`` where ``R_p`` is the refined
   prompt extracted from ``R`` (eq. 3).

A failed image generation is a scored failure (``image_error_s{k}``), never a crash.

Refined-prompt extraction (:func:`extract_refined_prompt`): think tags (``<think>``,
``</think>``, ``<thinking>``, ``<reasoning>`` ...) and markdown emphasis/headings are removed, then
the text after the **last** explicit marker among ``refined prompt:``, ``final scene prompt:``,
``final prompt:`` (case-insensitive) is taken. The public reference regex also accepts a bare
``prompt`` as a marker, so any later mention of the word ("this prompt captures ...") wins and
the refined prompt becomes a fragment of commentary; we only accept the three explicit markers.
Without any marker the last paragraph is used and counted as a fallback. The rule that fired is
stored per sample (``extraction_rule``).

Each rank runs the instances of its ``shard_indices``, and records and counts those it owns
(:meth:`~unicon.evaluation.category_counts.CategoryCounts.gathered`); rank 0 writes the files.

Files (:func:`evaluate_ureason` with ``out_dir``): ``ureason.json`` (metrics and run info),
``samples.jsonl`` (one :func:`sample_record` per instance: prompts, trace, refined prompt, image
paths, judge replies, verdicts, truncation flags), ``table.md`` (the paper's Table 2 layout) and
``images/s{1,2,3}/<category>_<id>.png``. :func:`table_rows` gives the three settings' images side
by side for :func:`unicon.evaluation.logs.log_table`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image

from unicon.config import UReasonEvalConfig
from unicon.data.ureason import UReasonInstance
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.distributed import shard_indices, writes_outputs
from unicon.evaluation.framework import eval_mode, write_images, write_results
from unicon.evaluation.retry import draw_images
from unicon.evaluation.ureason.judges import Judge, Verdict
from unicon.evaluation.ureason.metrics import (
    EMPTY_RULE,
    FALLBACK_RULE,
    SETTINGS,
    UReasonMetric,
    markdown_table,
    metric_categories,
)
from unicon.evaluation.ureason.plots import plot_results
from unicon.models.base import ImageGenerationConfig, UnifiedModel
from unicon.progress import track

# ---------------------------------------------------------------------------------------------
# Refined-prompt extraction
# ---------------------------------------------------------------------------------------------
MARKERS = ("refined prompt", "final scene prompt", "final prompt")

_MARKER = re.compile(r"\b(refined\s+prompt|final\s+scene\s+prompt|final\s+prompt)\s*:", re.IGNORECASE)
_THINK_TAG = re.compile(r"</?\s*(?:think|thinking|thought|thoughts|reasoning)\s*>", re.IGNORECASE)
_STAR_EMPHASIS = re.compile(r"(?<!\*)(\*{1,3})(?=\S)(.+?)(?<=\S)\1(?!\*)", re.DOTALL)
_UNDERSCORE_EMPHASIS = re.compile(r"(?<!\w)(_{1,3})(?=\S)(.+?)(?<=\S)\1(?!\w)", re.DOTALL)
_HEADING = re.compile(r"^[ \t]*#{1,6}[ \t]*", re.MULTILINE)
_WRAPPERS = [("{", "}"), ('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("`", "`"), ("[", "]")]


@dataclass
class Extraction:
    """The refined prompt ``R_p`` and the rule that produced it."""

    text: str
    rule: str  # one of MARKERS, FALLBACK_RULE or EMPTY_RULE

    @property
    def fallback(self) -> bool:
        return self.rule == FALLBACK_RULE


def clean_trace(trace: str) -> str:
    """Remove think-style tags, markdown headings and emphasis (``**x**``, ``*x*``, ``__x__``)."""
    text = _THINK_TAG.sub("\n", trace)
    text = _HEADING.sub("", text)
    text = _STAR_EMPHASIS.sub(r"\2", text)
    text = _UNDERSCORE_EMPHASIS.sub(r"\2", text)
    return text


def _unwrap(text: str) -> str:
    """Strip wrapping quotes/braces (``{...}``, ``"..."``) that enclose the whole text only."""
    text = text.strip()
    changed = True
    while changed and len(text) >= 2:
        changed = False
        for left, right in _WRAPPERS:
            inner = text[1:-1]
            if text[0] == left and text[-1] == right and left not in inner and right not in inner:
                text, changed = inner.strip(), True
    return text


def extract_refined_prompt(trace: str) -> Extraction:
    """``R_p`` from a reasoning trace ``R`` (see the module docstring for the rules)."""
    text = clean_trace(trace or "")
    matches = list(_MARKER.finditer(text))
    if matches:
        last = matches[-1]
        rule = " ".join(last.group(1).lower().split())
        refined = _unwrap(text[last.end() :])
        return Extraction(refined, rule if refined else EMPTY_RULE)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs:
        return Extraction("", EMPTY_RULE)
    return Extraction(_unwrap(paragraphs[-1]), FALLBACK_RULE)


# ---------------------------------------------------------------------------------------------
# Running the three settings
# ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """Everything produced for one instance (an image is ``None`` exactly when its error is set)."""

    instance: UReasonInstance
    trace: str = ""
    trace_truncated: bool = False
    trace_tokens: int = 0
    context_words_cut: int = 0  # words cut from the left of R to fit [P, R] (setting 2)
    refined: Extraction = field(default_factory=lambda: Extraction("", EMPTY_RULE))
    images: dict[int, Image.Image | None] = field(default_factory=dict)
    errors: dict[int, str | None] = field(default_factory=dict)
    verdicts: dict[int, Verdict] = field(default_factory=dict)
    chain: Verdict | None = None

    def passed(self, setting: int) -> bool:
        return setting in self.verdicts and self.verdicts[setting].passed


def generate_samples(
    model: UnifiedModel,
    instances: Sequence[UReasonInstance],
    max_new_tokens: int = UReasonEvalConfig.max_new_tokens,
    batch_size: int = UReasonEvalConfig.batch_size,
    image_config: ImageGenerationConfig | None = None,
) -> list[Sample]:
    """Run settings 1-3 for every instance (no judging)."""
    samples = [Sample(inst) for inst in instances]
    for batch in preemption.batches(samples, batch_size, "ureason: generation (settings 1-3)"):
        draw_images(model, batch, 1, [s.instance.direct_prompt for s in batch], image_config)  # setting 1
        # reasoning trace R (shared by settings 2 and 3)
        gens = model.reason([s.instance.prompt for s in batch], max_new_tokens=max_new_tokens)
        if len(gens) != len(batch):
            raise RuntimeError(f"reason returned {len(gens)} traces for {len(batch)} prompts")
        for s, g in zip(batch, gens):
            s.trace, s.trace_truncated, s.trace_tokens = g.text, bool(g.truncated), int(g.num_tokens)
            s.refined = extract_refined_prompt(g.text)
        # setting 2: M([P, R]) -- the trace follows the prompt; an over-long input loses R's beginning
        prompts2 = [s.instance.prompt for s in batch]
        contexts, cut = model.fit_context(prompts2, [s.trace for s in batch])
        for s, n in zip(batch, cut):
            s.context_words_cut = int(n)
        draw_images(model, batch, 2, prompts2, image_config, context=contexts)
        # setting 3: R_p alone (no image for an empty R_p)
        draw_images(model, batch, 3, [s.refined.text for s in batch], image_config, empty="empty refined prompt")
    return samples


def judge_samples(judge: Judge, samples: Sequence[Sample]) -> None:
    """Fill ``verdicts`` (and ``chain`` when the judge can judge reasoning chains) in place."""
    instances = [s.instance for s in samples]
    for k in track(SETTINGS, f"ureason: judging ({judge.name})", unit="settings"):
        verdicts = judge.judge_images(instances, [s.images.get(k) for s in samples])
        if len(verdicts) != len(samples):
            raise RuntimeError(f"judge '{judge.name}' returned {len(verdicts)} verdicts for {len(samples)} images")
        for s, v in zip(samples, verdicts):
            s.verdicts[k] = v
    if judge.judges_reasoning:
        verdicts = judge.judge_reasoning(instances, [s.trace for s in samples], [s.refined.text for s in samples])
        for s, v in zip(samples, verdicts):
            s.chain = v


# ---------------------------------------------------------------------------------------------
# Per-sample records and files
# ---------------------------------------------------------------------------------------------
def sample_record(s: Sample, image_paths: dict[int, str | None]) -> dict[str, Any]:
    """One row of ``samples.jsonl``; the metric is computed from these rows."""
    inst = s.instance
    rec: dict[str, Any] = {
        "id": inst.id,
        "category": inst.category,
        "source": inst.source,
        "direct_prompt": inst.direct_prompt,
        "prompt": inst.prompt,
        "expect_en": inst.expect_en,
        "trace": s.trace,
        "trace_truncated": s.trace_truncated,
        "trace_tokens": s.trace_tokens,
        "context_words_cut": s.context_words_cut,
        "refined_prompt": s.refined.text,
        "extraction_rule": s.refined.rule,
    }
    for k in SETTINGS:
        v = s.verdicts.get(k)
        rec[f"image_s{k}"] = image_paths.get(k)
        error = s.errors.get(k)
        rec[f"image_error_s{k}"] = error if error is not None or s.images.get(k) is not None else "no image"
        rec[f"judge_reply_s{k}"] = v.reply if v else None
        rec[f"verdict_s{k}"] = v.status if v else None
        rec[f"judge_truncated_s{k}"] = v.truncated if v else None
        rec[f"correct_s{k}"] = s.passed(k)
    rec["chain_reply"] = s.chain.reply if s.chain else None
    rec["chain_verdict"] = s.chain.status if s.chain else None
    rec["chain_truncated"] = s.chain.truncated if s.chain else None
    return rec


def save_images(out_dir: Path, s: Sample) -> dict[int, str | None]:
    """Save a sample's images as ``images/s{k}/<category>_<id>.png``; ``{k: path relative to out_dir}``."""
    paths = write_images(out_dir, {f"s{k}": s.images.get(k) for k in SETTINGS}, s.instance.key)
    return {k: paths[f"s{k}"] for k in SETTINGS}


TABLE_COLUMNS = [
    "id", "category", "expect_en", "direct_prompt", "trace", "refined_prompt", "extraction_rule",
    "image_s1", "verdict_s1", "image_s2", "verdict_s2", "image_s3", "verdict_s3", "chain_verdict",
]


def table_rows(samples: Sequence[Sample], limit: int | None = None) -> list[list[Any]]:
    """Rows for :func:`log_table`: the three settings' images side by side per sample."""
    rows = []
    for s in samples[:limit]:
        i = s.instance
        rows.append([
            str(i.id), i.category, i.expect_en, i.direct_prompt, s.trace, s.refined.text, s.refined.rule,
            s.images.get(1), s.verdicts[1].status, s.images.get(2), s.verdicts[2].status,
            s.images.get(3), s.verdicts[3].status, s.chain.status if s.chain else None,
        ])
    return rows


def evaluate_ureason(
    model: UnifiedModel,
    instances: Sequence[UReasonInstance],
    judge: Judge,
    out_dir: str | Path | None = None,
    max_new_tokens: int = UReasonEvalConfig.max_new_tokens,
    batch_size: int = UReasonEvalConfig.batch_size,
    image_config: ImageGenerationConfig | None = None,
    info: dict | None = None,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, float], list[Sample]]:
    """Generate, judge and score ``instances`` on every rank of the process group (or alone).

    Returns the metrics (the same on every rank) and this rank's samples, in its shard's order; with
    ``out_dir``, the files of the module docstring (``ureason.json``: ``{"metrics", "judge", **info}``).
    ``device`` holds the metric states (the process group's device: CUDA under NCCL).
    """
    if not instances:
        raise UserError("UReason: no instances to evaluate")
    mine = shard_indices(len(instances))
    with eval_mode(model):
        samples = generate_samples(model, [instances[i] for i in mine], max_new_tokens, batch_size, image_config)
    judge_samples(judge, samples)

    out = Path(out_dir) if out_dir is not None else None
    metrics, records = UReasonMetric.gathered(instances, mine, samples, sample_record, save_images, out, device)
    if out is not None and writes_outputs():  # and settings_by_category.png (:mod:`.plots`)
        write_results(out, "ureason.json", {"metrics": metrics, "judge": judge.name, **(info or {})},
                      records, markdown_table(metrics, metric_categories(metrics)))
        plot_results(metrics, out)
    return metrics, samples
