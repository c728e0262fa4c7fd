"""UReason: does a unified model's reasoning reach the pixels? (Yang et al., secs. 3-5)

Three settings per instance, all through :class:`unicon.models.base.UnifiedModel`:

1. **direct** -- ``I = M(P_direct)``: ``generate_image([direct_prompt])`` (eq. 1);
2. **reasoning-guided** -- ``R = M(P)`` with ``reason([prompt])``, then ``I = M([P, R])``:
   ``generate_image([prompt], context=[R])`` (eq. 2);
3. **de-contextualized** -- ``I = M(R_p)``: ``generate_image([R_p])`` where ``R_p`` is the refined
   prompt extracted from ``R`` (eq. 3).

Metrics (sec. 3.2), over the N instances evaluated, in percent:

* ``acc_s{k} = 100 * sum_i 1[judge(I_i^k, C_i) == yes] / N``, overall and per category
  (``acc_s{k}/<category>``). **A missing or failed image, an unparseable judge reply, or an empty
  refined prompt counts as a failure and stays in N.** The public reference code drops samples
  whose image is missing from the denominator, which inflates accuracy for models that crash;
  ``acc_s{k}_excl_missing`` reports that number for comparison only.
* ``delta_12 = acc_s2 - acc_s1`` and ``delta_23 = acc_s3 - acc_s2`` (eq. 5, consecutive settings),
  overall and per category.
* ``chain_acc = 100 * sum_i 1[chain_judge(P_i, R_i, C_i) == yes] / N`` -- reasoning-chain accuracy
  (Table 3), when the judge can judge chains.
* ``fallback_rate = 100 * #(no marker, last paragraph used) / N`` and ``empty_refined_rate``.
* counts: ``missing_s{k}``, ``unparseable_s{k}``, ``judge_truncated_s{k}``, ``trace_truncated``,
  ``chain_unparseable``, ``context_cut_s2`` (setting-2 inputs ``[P, R]`` too long for the model,
  whose trace was cut from the left with ``UnifiedModel.fit_context``; the words cut are in each
  sample's ``context_words_cut``).

Refined-prompt extraction (:func:`extract_refined_prompt`): think tags (``<think>``,
``</think>``, ``<thinking>``, ``<reasoning>`` ...) and markdown emphasis/headings are removed, then
the text after the **last** explicit marker among ``refined prompt:``, ``final scene prompt:``,
``final prompt:`` (case-insensitive) is taken. The public reference regex also accepts a bare
``prompt`` as a marker, so any later mention of the word ("this prompt captures ...") wins and
the refined prompt becomes a fragment of commentary; we only accept the three explicit markers.
Without any marker the last paragraph is used and counted as a fallback. The rule that fired is
stored per sample (``extraction_rule``).

Outputs (:func:`write_outputs`): ``ureason.json`` (metrics + run info), ``samples.jsonl`` (one row
per instance: prompts, trace, refined prompt, image paths, judge replies, verdicts, truncation
flags), ``table.md`` (the paper's Table 2 layout), ``images/s{1,2,3}/<category>_<id>.png``, and a
W&B table with the three settings' images side by side (:func:`unicon.evaluation.callbacks.log_table`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Sequence

import torch
from PIL import Image

from unicon.data.ureason import CATEGORIES, UReasonInstance, load_shapes_ureason, load_ureason
from unicon.config import UReasonEvalConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.cli_common import add_common_args, check_common_args, load_model_for
from unicon.evaluation.callbacks import EvalCallback, log_eval_config, log_metrics, log_table
from unicon.evaluation.judges import Judge, Verdict, build_judge, check_judge_spec
from unicon.models.base import ImageGenerationConfig, UnifiedModel

log = logging.getLogger(__name__)

SETTINGS = (1, 2, 3)
SETTING_NAMES = {1: "Direct", 2: "Reasoning-Guided", 3: "De-contextualized"}

# ---------------------------------------------------------------------------------------------
# Refined-prompt extraction
# ---------------------------------------------------------------------------------------------
MARKERS = ("refined prompt", "final scene prompt", "final prompt")
FALLBACK_RULE = "last_paragraph"
EMPTY_RULE = "empty"

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
    """Everything produced for one instance."""

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


def _generate_safely(
    model: UnifiedModel,
    prompts: Sequence[str],
    context: Sequence[str] | None,
    config: ImageGenerationConfig | None,
) -> tuple[list[Image.Image | None], list[str | None]]:
    """``generate_image`` on a batch; a failing batch is retried one prompt at a time so that one
    bad sample costs only itself. Failures come back as ``None`` with the error text."""
    try:
        images = model.generate_image(list(prompts), context=list(context) if context is not None else None,
                                      config=config)
        if len(images) != len(prompts):
            raise RuntimeError(f"generate_image returned {len(images)} images for {len(prompts)} prompts")
        bad = [i for i, im in enumerate(images) if not isinstance(im, Image.Image)]
        errors: list[str | None] = [None] * len(prompts)
        for i in bad:
            errors[i] = f"generate_image returned {type(images[i]).__name__}, not a PIL image"
        return [None if i in bad else im for i, im in enumerate(images)], errors
    except Exception as e:  # noqa: BLE001 -- a failed image is a scored failure, never a crash
        if len(prompts) == 1:
            log.warning("generate_image failed: %s", e)
            return [None], [f"{type(e).__name__}: {e}"]
    images, errors = [], []
    for i in range(len(prompts)):
        im, err = _generate_safely(model, prompts[i : i + 1], None if context is None else context[i : i + 1], config)
        images += im
        errors += err
    return images, errors


def generate_samples(
    model: UnifiedModel,
    instances: Sequence[UReasonInstance],
    max_new_tokens: int = 256,
    batch_size: int = 8,
    image_config: ImageGenerationConfig | None = None,
) -> list[Sample]:
    """Run settings 1-3 for every instance (no judging)."""
    samples = [Sample(inst) for inst in instances]
    for start in range(0, len(samples), batch_size):
        preemption.check()
        batch = samples[start : start + batch_size]
        # setting 1
        ims, errs = _generate_safely(model, [s.instance.direct_prompt for s in batch], None, image_config)
        for s, im, err in zip(batch, ims, errs):
            s.images[1], s.errors[1] = im, err
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
        ims, errs = _generate_safely(model, prompts2, contexts, image_config)
        for s, im, err in zip(batch, ims, errs):
            s.images[2], s.errors[2] = im, err
        # setting 3: R_p alone (no image for an empty R_p)
        todo = [s for s in batch if s.refined.text]
        for s in batch:
            if not s.refined.text:
                s.images[3], s.errors[3] = None, "empty refined prompt"
        if todo:
            ims, errs = _generate_safely(model, [s.refined.text for s in todo], None, image_config)
            for s, im, err in zip(todo, ims, errs):
                s.images[3], s.errors[3] = im, err
    return samples


def judge_samples(judge: Judge, samples: Sequence[Sample]) -> None:
    """Fill ``verdicts`` (and ``chain`` when the judge can judge reasoning chains) in place."""
    instances = [s.instance for s in samples]
    for k in SETTINGS:
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
# Metrics
# ---------------------------------------------------------------------------------------------
COUNT_FIELDS = (
    "n",
    *(f"pass_s{k}" for k in SETTINGS),
    *(f"missing_s{k}" for k in SETTINGS),
    *(f"unparseable_s{k}" for k in SETTINGS),
    *(f"judge_truncated_s{k}" for k in SETTINGS),
    "chain_pass",
    "chain_judged",
    "chain_unparseable",
    "fallback",
    "empty_refined",
    "trace_truncated",
    "context_cut_s2",
)


def count_matrix(samples: Sequence[Sample], categories: Sequence[str]) -> torch.Tensor:
    """``[len(categories), len(COUNT_FIELDS)]`` float64 counts (summable across DDP ranks)."""
    col = {f: j for j, f in enumerate(COUNT_FIELDS)}
    row = {c: i for i, c in enumerate(categories)}
    counts = torch.zeros(len(categories), len(COUNT_FIELDS), dtype=torch.float64)
    for s in samples:
        r = row[s.instance.category]
        counts[r, col["n"]] += 1
        for k in SETTINGS:
            v = s.verdicts.get(k)
            counts[r, col[f"pass_s{k}"]] += float(s.passed(k))
            counts[r, col[f"missing_s{k}"]] += float(s.images.get(k) is None)
            counts[r, col[f"unparseable_s{k}"]] += float(v is not None and v.status == "unparseable")
            counts[r, col[f"judge_truncated_s{k}"]] += float(v is not None and v.truncated)
        if s.chain is not None:
            counts[r, col["chain_judged"]] += 1
            counts[r, col["chain_pass"]] += float(s.chain.passed)
            counts[r, col["chain_unparseable"]] += float(s.chain.status == "unparseable")
        counts[r, col["fallback"]] += float(s.refined.fallback)
        counts[r, col["empty_refined"]] += float(s.refined.rule == EMPTY_RULE)
        counts[r, col["trace_truncated"]] += float(s.trace_truncated)
        counts[r, col["context_cut_s2"]] += float(s.context_words_cut > 0)
    return counts


def _pct(num: float, den: float) -> float:
    return 100.0 * num / den if den else float("nan")


def metrics_from_counts(counts: torch.Tensor, categories: Sequence[str]) -> dict[str, float]:
    """The metrics of the module docstring from a :func:`count_matrix` (percent, counts as floats)."""
    col = {f: j for j, f in enumerate(COUNT_FIELDS)}
    total = counts.sum(0)
    m: dict[str, float] = {}

    def accs(c: torch.Tensor, suffix: str) -> None:
        n = float(c[col["n"]])
        for k in SETTINGS:
            m[f"acc_s{k}{suffix}"] = _pct(float(c[col[f"pass_s{k}"]]), n)
        m[f"delta_12{suffix}"] = m[f"acc_s2{suffix}"] - m[f"acc_s1{suffix}"]
        m[f"delta_23{suffix}"] = m[f"acc_s3{suffix}"] - m[f"acc_s2{suffix}"]
        if float(c[col["chain_judged"]]):
            m[f"chain_acc{suffix}"] = _pct(float(c[col["chain_pass"]]), n)

    accs(total, "")
    n = float(total[col["n"]])
    m["n"] = n
    for k in SETTINGS:
        present = n - float(total[col[f"missing_s{k}"]])
        m[f"acc_s{k}_excl_missing"] = _pct(float(total[col[f"pass_s{k}"]]), present)
        for f in ("missing", "unparseable", "judge_truncated"):
            m[f"{f}_s{k}"] = float(total[col[f"{f}_s{k}"]])
    m["fallback_rate"] = _pct(float(total[col["fallback"]]), n)
    m["empty_refined_rate"] = _pct(float(total[col["empty_refined"]]), n)
    m["trace_truncated"] = float(total[col["trace_truncated"]])
    m["context_cut_s2"] = float(total[col["context_cut_s2"]])
    if float(total[col["chain_judged"]]):
        m["chain_unparseable"] = float(total[col["chain_unparseable"]])
    for i, cat in enumerate(categories):
        if float(counts[i, col["n"]]):
            accs(counts[i], f"/{cat}")
    return m


def compute_metrics(samples: Sequence[Sample], categories: Sequence[str] | None = None) -> dict[str, float]:
    categories = categories or ordered_categories(s.instance for s in samples)
    return metrics_from_counts(count_matrix(samples, categories), categories)


def ordered_categories(instances: Iterable[UReasonInstance]) -> list[str]:
    """Categories present, in the paper's column order (unknown ones after, sorted)."""
    seen = {inst.category for inst in instances}
    return [c for c in CATEGORIES if c in seen] + sorted(seen - set(CATEGORIES))


def markdown_table(metrics: dict[str, float], categories: Sequence[str]) -> str:
    """The paper's Table 2 layout: one row per setting, Acc and Δ per category and overall."""
    cols = [(c, f"/{c}") for c in categories if f"acc_s1/{c}" in metrics] + [("overall", "")]
    head = "| Setting | " + " | ".join(f"{c.capitalize()} Acc | {c.capitalize()} Δ" for c, _ in cols) + " |"
    sep = "|---|" + "---:|---:|" * len(cols)
    lines = [head, sep]
    for k in SETTINGS:
        cells = []
        for _, suf in cols:
            acc = metrics[f"acc_s{k}{suf}"]
            delta = "-" if k == 1 else f"{metrics[f'delta_{k - 1}{k}{suf}']:+.1f}"
            cells.append(f"{acc:.1f} | {delta}")
        lines.append(f"| {k} {SETTING_NAMES[k]} | " + " | ".join(cells) + " |")
    if "chain_acc" in metrics:
        chain = ", ".join(
            f"{c} {metrics[f'chain_acc{suf}']:.1f}" for c, suf in cols if f"chain_acc{suf}" in metrics
        )
        lines.append("")
        lines.append(f"Reasoning-chain accuracy (Table 3): {chain}.")
    lines.append(
        f"Extraction fallback rate: {metrics['fallback_rate']:.1f}% "
        f"(empty refined prompt: {metrics['empty_refined_rate']:.1f}%); "
        f"missing images s1/s2/s3: {metrics['missing_s1']:.0f}/{metrics['missing_s2']:.0f}/{metrics['missing_s3']:.0f} "
        f"(counted as failures); N = {metrics['n']:.0f}."
    )
    per_setting = "/".join(f"{metrics[f'unparseable_s{k}']:.0f}" for k in SETTINGS)
    cut = "/".join(f"{metrics[f'judge_truncated_s{k}']:.0f}" for k in SETTINGS)
    lines.append(
        f"Unparseable judge replies s1/s2/s3: {per_setting} (failures); truncated judge replies: {cut}; "
        f"truncated reasoning traces: {metrics['trace_truncated']:.0f}; setting-2 inputs [P, R] cut to fit: "
        f"{metrics.get('context_cut_s2', 0):.0f}."
    )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------
def sample_record(s: Sample, image_paths: dict[int, str | None]) -> dict[str, Any]:
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
        rec[f"image_error_s{k}"] = s.errors.get(k)
        rec[f"judge_reply_s{k}"] = v.reply if v else None
        rec[f"verdict_s{k}"] = v.status if v else None
        rec[f"judge_truncated_s{k}"] = v.truncated if v else None
        rec[f"correct_s{k}"] = s.passed(k)
    rec["chain_reply"] = s.chain.reply if s.chain else None
    rec["chain_verdict"] = s.chain.status if s.chain else None
    rec["chain_truncated"] = s.chain.truncated if s.chain else None
    return rec


def write_outputs(
    out_dir: str | Path, samples: Sequence[Sample], metrics: dict[str, float], info: dict | None = None,
    samples_name: str = "samples.jsonl", summary: bool = True,
) -> Path:
    """Write images and ``samples_name``, and with ``summary`` also ``ureason.json`` and ``table.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / samples_name).open("w") as f:
        for s in samples:
            paths: dict[int, str | None] = {}
            for k in SETTINGS:
                im = s.images.get(k)
                if im is None:
                    paths[k] = None
                    continue
                rel = Path("images") / f"s{k}" / f"{s.instance.key}.png"
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                im.save(out / rel)
                paths[k] = str(rel)
            f.write(json.dumps(sample_record(s, paths), ensure_ascii=False) + "\n")
    if not summary:
        return out
    categories = [c for c in CATEGORIES if f"acc_s1/{c}" in metrics]
    categories += sorted(k.split("/", 1)[1] for k in metrics if k.startswith("acc_s1/") and k[7:] not in CATEGORIES)
    (out / "ureason.json").write_text(json.dumps({"metrics": metrics, **(info or {})}, indent=2, default=str) + "\n")
    (out / "table.md").write_text(markdown_table(metrics, categories))
    return out


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
    max_new_tokens: int = 256,
    batch_size: int = 8,
    image_config: ImageGenerationConfig | None = None,
    info: dict | None = None,
) -> tuple[dict[str, float], list[Sample]]:
    """Generate, judge and score ``instances``; write the outputs when ``out_dir`` is given."""
    if not instances:
        raise UserError("UReason: no instances to evaluate")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            samples = generate_samples(model, instances, max_new_tokens, batch_size, image_config)
    finally:
        model.train(was_training)
    judge_samples(judge, samples)
    metrics = compute_metrics(samples)
    if out_dir is not None:
        write_outputs(out_dir, samples, metrics, {"judge": judge.name, **(info or {})})
    return metrics, samples


def subset(instances: Sequence[UReasonInstance], n: int | None) -> list[UReasonInstance]:
    """The first ``n`` instances taken round-robin over categories (so every category appears)."""
    if n is None or n >= len(instances):
        return list(instances)
    by_cat: dict[str, list[UReasonInstance]] = {}
    for inst in instances:
        by_cat.setdefault(inst.category, []).append(inst)
    out: list[UReasonInstance] = []
    depth = 0
    while len(out) < n:
        for rows in by_cat.values():
            if depth < len(rows) and len(out) < n:
                out.append(rows[depth])
        depth += 1
    return out


def load_instances(data: str | Path, split: str | None = None, categories: Sequence[str] | None = None):
    """``data`` is a UReason directory (``direct_<cat>.jsonl`` pairs) or a ShapesWorld root."""
    data = Path(data)
    if not data.exists():
        raise UserError(f"UReason data {data} does not exist")
    if not any(data.glob("direct_*.jsonl")) and (data / "ureason").is_dir():
        return load_shapes_ureason(data, split=split, categories=categories)
    return load_ureason(data, split=split, categories=categories)


def check_judge_fits(judge_spec: Any, instances: Sequence[UReasonInstance]) -> None:
    """The exact judge needs ShapesWorld prompts; say so before any image is generated."""
    if judge_spec == "exact":
        missing = [i.source for i in instances if i.target_scene is None]
        if missing:
            raise UserError(
                f"judge 'exact' needs ShapesWorld prompts with 'target_scene' ({len(missing)} rows lack it, "
                f"first {missing[0]}); judge real UReason data with --judge vlm:<model path>"
            )


def world_root_of(data: str | Path) -> str | None:
    """The ShapesWorld root (holding ``world.json``) of a data path, if it is one."""
    data = Path(data)
    for root in (data, data.parent):
        if (root / "world.json").is_file():
            return str(root)
    return None


# ---------------------------------------------------------------------------------------------
# Epoch-end callback
# ---------------------------------------------------------------------------------------------
HEADLINE = ("acc_s1", "acc_s2", "acc_s3", "delta_12", "delta_23", "chain_acc", "fallback_rate")


class UReasonCallback(EvalCallback):
    """Runs the three settings on a small subset at epoch end and logs ``ureason/acc_s{1,2,3}``,
    ``ureason/delta_12``, ``ureason/delta_23`` (+ ``chain_acc``, ``fallback_rate``).

    Under DDP each rank takes every ``world_size``-th instance and the counts are summed.
    """

    name = "ureason"

    def __init__(
        self,
        data: str | Path,
        judge: str | Judge = "exact",
        chain_judge: str | None = None,
        max_samples: int | None = 32,
        max_new_tokens: int = 128,
        batch_size: int = 8,
        table_rows: int = 8,
        every_n_epochs: int = 1,
        fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        self.data, self.max_samples = data, max_samples
        self.max_new_tokens, self.batch_size, self.table_rows = max_new_tokens, batch_size, table_rows
        self._judge_spec, self._chain_spec = judge, chain_judge
        self._judge: Judge | None = judge if isinstance(judge, Judge) else None
        self._instances: list[UReasonInstance] | None = None

    @classmethod
    def from_config(cls, cfg: Any, fail_on_error: bool = False) -> "UReasonCallback":
        """From a RunConfig: ``eval.ureason.*``; data defaults to ``<data.root>`` (its ``ureason/``)."""
        u = cfg.eval.ureason
        return cls(
            data=u.data or cfg.data.root,
            judge=u.judge,
            chain_judge=getattr(u, "chain_judge", None),
            max_samples=u.max_samples,
            max_new_tokens=u.max_new_tokens,
            batch_size=getattr(u, "batch_size", 8),
            table_rows=getattr(u, "table_rows", 8),
            every_n_epochs=u.every_n_epochs,
            fail_on_error=fail_on_error or cfg.eval.fail_on_error,
        )

    def instances(self) -> list[UReasonInstance]:
        if self._instances is None:
            self._instances = subset(load_instances(self.data), self.max_samples)
            check_judge_fits(self._judge_spec, self._instances)
        return self._instances

    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = build_judge(str(self._judge_spec), chain=self._chain_spec,
                                      world_root=world_root_of(self.data))
        return self._judge

    def evaluate(self, trainer, model) -> dict[str, float]:
        rank, world = trainer.global_rank, trainer.world_size
        mine = self.instances()[rank::world]
        samples = generate_samples(model, mine, self.max_new_tokens, self.batch_size)
        judge_samples(self.judge(), samples)
        categories = ordered_categories(self.instances())
        counts = count_matrix(samples, categories)
        if world > 1:
            counts = trainer.strategy.reduce(counts.to(trainer.strategy.root_device), reduce_op="sum").cpu()
        metrics = metrics_from_counts(counts, categories)
        out = self.output_dir(trainer)
        name = "samples.jsonl" if world == 1 else f"samples.rank{rank}.jsonl"
        write_outputs(out, samples, metrics, {"epoch": trainer.current_epoch + 1}, samples_name=name,
                      summary=rank == 0)
        log_table(trainer.loggers, "ureason/samples", TABLE_COLUMNS, table_rows(samples, self.table_rows),
                  step=trainer.global_step)
        return {f"ureason/{k}": metrics[k] for k in HEADLINE if k in metrics}


# ---------------------------------------------------------------------------------------------
# `unicon evaluate ureason`
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unicon evaluate ureason",
        description="UReason: direct, reasoning-guided and de-contextualized generation, judged.",
    )
    add_common_args(p)
    p.add_argument("--data", required=True,
                   help="UReason directory (direct_<cat>.jsonl + <cat>.jsonl) or a ShapesWorld root")
    p.add_argument("--judge", default="exact",
                   help="'exact' (ShapesWorld verifier) or 'vlm:<path>' (image-text-to-text model)")
    p.add_argument("--chain-judge", default=None, help="causal LM path for the reasoning-chain judge (Table 3)")
    p.add_argument("--split", choices=["test", "testmini"], default=None,
                   help="split of the UReason release (a ShapesWorld root has one split)")
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--max-samples", type=int, default=None, help="round-robin subset over categories")
    p.add_argument("--max-new-tokens", type=int, default=UReasonEvalConfig.max_new_tokens,
                   help="token budget of the reasoning trace")
    p.add_argument("--batch-size", type=int, default=UReasonEvalConfig.batch_size)
    p.add_argument("--seed", type=int, default=None, help="image sampling seed (greedy by default)")
    p.add_argument("--judge-dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--judge-max-new-tokens", type=int, default=512)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")
    p.add_argument("--table-rows", type=int, default=UReasonEvalConfig.table_rows, help="samples in the W&B image table")
    return p


def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from unicon.models import weights_fingerprint
    from unicon.training.loggers import make_loggers

    out = check_common_args(args, ("max_samples", "max_new_tokens", "batch_size", "judge_max_new_tokens",
                                   "table_rows"), {"table_rows": 0})
    check_judge_spec(args.judge, args.chain_judge)
    if args.split and world_root_of(args.data) is not None:
        raise UserError(f"--split {args.split}: {args.data} is a ShapesWorld root, which has one split; "
                        "--split selects a split of the UReason release")
    instances = subset(load_instances(args.data, split=args.split, categories=args.categories), args.max_samples)
    check_judge_fits(args.judge, instances)
    judge = build_judge(args.judge, chain=args.chain_judge, world_root=world_root_of(args.data),
                        device=args.device, dtype=args.judge_dtype,
                        trust_remote_code=args.trust_remote_code, max_new_tokens=args.judge_max_new_tokens)
    model = load_model_for(args)
    config = dataclasses.replace(model.image_generation_config, seed=args.seed)
    info = {"ckpt": str(args.ckpt), "checkpoint": str(Path(args.ckpt).resolve()),
            "model_fingerprint": weights_fingerprint(model), "data": str(args.data), "split": args.split,
            "max_new_tokens": args.max_new_tokens, "chain_judge": args.chain_judge}
    with preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch, exit 128 + signal
        metrics, samples = evaluate_ureason(model, instances, judge, out, args.max_new_tokens, args.batch_size,
                                            config, info)
    logger_section = SimpleNamespace(type=args.logger, mode=None, project=None, entity=None, tags=[])
    logger_cfg = SimpleNamespace(name=f"ureason-{out.name}", logger=logger_section)
    loggers = make_loggers(logger_cfg, out)
    log_eval_config(loggers, args, info["model_fingerprint"])
    log_metrics(loggers, {f"ureason/{k}": v for k, v in metrics.items()}, step=0)
    log_table(loggers, "ureason/samples", TABLE_COLUMNS, table_rows(samples, args.table_rows), step=0)
    for lg in loggers:
        lg.finalize("success")
    print((out / "table.md").read_text(), end="")
    print(f"wrote {out / 'ureason.json'} and {out / 'samples.jsonl'}")
    return 0
