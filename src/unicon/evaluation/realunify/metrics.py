"""RealUnify's numbers from per-sample records; no I/O, no model.

:class:`RealUnifyMetric` is a torchmetrics ``Metric`` whose states are per-category **sums** of
per-sample indicators (``dist_reduce_fx="sum"``), so a sync over ranks -- or the merge of ``--shard``
jobs, which replays that sync over the saved states (:mod:`unicon.evaluation.distributed`) -- gives
the counts of the whole evaluation set, as long as every sample is counted on exactly one rank.

With settings ``s`` in {direct, stepwise}, ``N_c^s`` the instances of category ``c`` evaluated in
setting ``s`` and ``y_i^s`` = 1 when instance ``i`` is right in ``s`` (UEG: **every** polling
question got its expected answer; GEU: the parsed letter equals the answer), ``compute()`` returns
(accuracies in percent):

* ``acc_<s>/<c> = 100 * sum_{i in c} y_i^s / N_c^s`` per category;
* ``acc_<s>/ueg``, ``acc_<s>/geu`` and ``acc_<s>`` (overall) = ``100 * sum_i y_i^s / sum N^s`` over the
  axis's (all) instances, the micro average: with the paper's 100 instances per category it equals
  the mean of the category accuracies. The authors' "Total Acc" is per axis (``acc_<s>/ueg``,
  ``acc_<s>/geu``); the pooled ``acc_<s>`` over both axes is ours, not a figure of the paper;
* ``delta/<c>``, ``delta/ueg``, ``delta/geu``, ``delta = acc_stepwise - acc_direct`` (same keys),
  when both settings ran;
* UEG per-question accuracy ``q_acc_<s>/<c> = 100 * sum_{i in c} sum_k 1[status_ik == answer_ik] /
  sum_{i in c} K_i`` (and ``q_acc_<s>/ueg`` over all UEG questions), reported beside the instance
  accuracy;
* stepwise edit accuracy of ShapesWorld GEU rows with a ``target_scene``: ``edit_acc/<c> = 100 *
  #(edited image parses to exactly target_scene) / #(rows with a target_scene)``, and ``edit_acc``;
* counts: ``n``, ``n/<c>``; per setting ``unparseable_<s>/geu`` (multiple-choice replies from which the
  run's ``letter_parse`` reads no letter), ``unparseable_<s>/ueg`` (judge replies that are not yes/no, per question),
  ``no_scene_<s>`` (UEG images the exact judge cannot parse), ``missing_<s>`` (no image: generation
  or editing failed, or an empty refined prompt), ``empty_refined`` and ``truncated_refined`` (stepwise
  UEG refinements that were empty, or cut at the ``max_new_tokens`` budget and drawn as cut). **Unparseable
  replies and missing images are failures that stay in the denominators.**

A ratio over zero instances is absent from the dict (not NaN), so a category without UEG
questions has no ``q_acc``. :func:`markdown_table` lays the numbers out per category.

A record is one row of ``samples.jsonl`` (:func:`unicon.evaluation.realunify.runner.sample_record`);
read here: ``category``, ``axis``, ``correct_<s>`` (None when the setting did not run),
``image_error_<s>``, ``statuses_<s>`` (UEG), ``questions`` (UEG), ``pred_<s>`` (GEU),
``edit_match`` (None without a target scene) and ``refined_prompt``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from unicon.config import REALUNIFY_SETTINGS
from unicon.evaluation.category_counts import CategoryCounts
from unicon.evaluation.realunify.data import AXES, axis_of, ordered_categories

SETTINGS = REALUNIFY_SETTINGS

#: the per-category sums kept as metric states
COUNTS = (
    "n",
    *(f"{name}_{s}" for s in SETTINGS for name in ("ran", "pass", "q_total", "q_pass", "unparseable", "no_scene",
                                                 "missing")),
    "edit_checked",
    "edit_match",
    "empty_refined",
    "truncated_refined",
)


def record_counts(record: Mapping[str, Any]) -> Counter:
    """The indicators one record adds to :data:`COUNTS`."""
    c: Counter = Counter(n=1)
    for s in SETTINGS:
        if record.get(f"correct_{s}") is None:
            continue
        c[f"ran_{s}"] += 1
        c[f"pass_{s}"] += bool(record[f"correct_{s}"])
        c[f"missing_{s}"] += record.get(f"image_error_{s}") is not None
        if record["axis"] == "ueg":
            statuses = record[f"statuses_{s}"]
            c[f"q_total_{s}"] += len(statuses)
            c[f"q_pass_{s}"] += sum(st == q["answer"] for st, q in zip(statuses, record["questions"]))
            c[f"unparseable_{s}"] += sum(st == "unparseable" for st in statuses)
            c[f"no_scene_{s}"] += bool(statuses) and all(st == "no_scene" for st in statuses)
        else:
            c[f"unparseable_{s}"] += record.get(f"pred_{s}") is None and record.get(f"image_error_{s}") is None
    if record.get("edit_match") is not None:
        c["edit_checked"] += 1
        c["edit_match"] += bool(record["edit_match"])
    stepwise_ueg = record["axis"] == "ueg" and record.get("correct_stepwise") is not None
    c["empty_refined"] += stepwise_ueg and not record.get("refined_prompt")
    c["truncated_refined"] += stepwise_ueg and bool(record.get("refined_truncated"))
    return c


def _pct(num: float, den: float) -> float | None:
    return 100.0 * num / den if den else None


class RealUnifyMetric(CategoryCounts):
    """Per-category sums of :data:`COUNTS`; ``compute()`` returns the metrics of the module docstring."""

    COUNTS = COUNTS
    record_counts = staticmethod(record_counts)
    ordered = staticmethod(ordered_categories)

    def compute(self) -> dict[str, float]:
        per_cat = self.per_category()
        groups: dict[str, dict[str, int]] = {}
        for i, cat in enumerate(self.categories):
            groups[cat] = {name: per_cat[name][i] for name in COUNTS}
        for axis in AXES:
            members = [c for c in self.categories if axis_of(c) == axis]
            groups[axis] = {name: sum(groups[c][name] for c in members) for name in COUNTS}
        total = {name: sum(per_cat[name]) for name in COUNTS}

        m: dict[str, float] = {"n": float(total["n"])}

        def put(key: str, value: float | None) -> None:
            if value is not None:
                m[key] = float(value)

        for suffix, c in (("", total), *((f"/{g}", groups[g]) for g in (*AXES, *self.categories))):
            if not c["n"]:
                continue
            for s in SETTINGS:
                put(f"acc_{s}{suffix}", _pct(c[f"pass_{s}"], c[f"ran_{s}"]))
                put(f"q_acc_{s}{suffix}", _pct(c[f"q_pass_{s}"], c[f"q_total_{s}"]))
            if f"acc_direct{suffix}" in m and f"acc_stepwise{suffix}" in m:
                m[f"delta{suffix}"] = m[f"acc_stepwise{suffix}"] - m[f"acc_direct{suffix}"]
            put(f"edit_acc{suffix}", _pct(c["edit_match"], c["edit_checked"]))
            if suffix and suffix[1:] in self.categories:
                m[f"n{suffix}"] = float(c["n"])
        for s in SETTINGS:
            if not total[f"ran_{s}"]:
                continue
            for axis in AXES:
                if groups[axis][f"ran_{s}"]:
                    m[f"unparseable_{s}/{axis}"] = float(groups[axis][f"unparseable_{s}"])
            m[f"missing_{s}"] = float(total[f"missing_{s}"])
            if groups["ueg"][f"ran_{s}"]:
                m[f"no_scene_{s}"] = float(total[f"no_scene_{s}"])
        if groups["ueg"]["ran_stepwise"]:
            m["empty_refined"] = float(total["empty_refined"])
            m["truncated_refined"] = float(total["truncated_refined"])
        if total["edit_checked"]:
            m["edit_n"] = float(total["edit_checked"])
        return m


#: :class:`RealUnifyMetric` over records in one process (categories: those of the records)
compute_metrics = RealUnifyMetric.of


def metric_categories(metrics: Mapping[str, float]) -> list[str]:
    """The categories with a per-category count ``n/<c>`` in ``metrics``, in the paper's order."""
    return ordered_categories(k.split("/", 1)[1] for k in metrics if k.startswith("n/"))


def _cell(metrics: Mapping[str, float], key: str, signed: bool = False) -> str:
    if key not in metrics:
        return "-"
    return f"{metrics[key]:+.1f}" if signed else f"{metrics[key]:.1f}"


def markdown_table(metrics: Mapping[str, float]) -> str:
    """One row per category, then per axis and overall: instance accuracy direct / stepwise, their
    difference, UEG per-question accuracy and GEU stepwise edit accuracy; then the counts."""
    lines = ["| axis | category | N | direct | stepwise | Δ (stepwise − direct) | per-question direct | "
             "per-question stepwise | edit acc |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    cats = metric_categories(metrics)
    rows = [(axis_of(c), c, f"/{c}", metrics[f"n/{c}"]) for c in cats]
    for axis in AXES:
        members = [c for c in cats if axis_of(c) == axis]
        if members:
            rows.append((axis, f"**{axis.upper()}**", f"/{axis}", sum(metrics[f"n/{c}"] for c in members)))
    rows.append(("", "**overall**", "", metrics["n"]))
    for axis, name, suf, n in rows:
        lines.append(f"| {axis.upper()} | {name} | {n:.0f} | {_cell(metrics, f'acc_direct{suf}')} | "
                     f"{_cell(metrics, f'acc_stepwise{suf}')} | {_cell(metrics, f'delta{suf}', True)} | "
                     f"{_cell(metrics, f'q_acc_direct{suf}')} | {_cell(metrics, f'q_acc_stepwise{suf}')} | "
                     f"{_cell(metrics, f'edit_acc{suf}')} |")
    notes = []
    for s in SETTINGS:
        parts = [f"{k.split('/')[1].upper()} {metrics[k]:.0f}" for k in (f"unparseable_{s}/ueg", f"unparseable_{s}/geu")
                 if k in metrics]
        if f"missing_{s}" in metrics:
            notes.append(f"{s}: unparseable replies {', '.join(parts) or '0'}, missing images {metrics[f'missing_{s}']:.0f}"
                         + (f", images the exact judge cannot parse {metrics[f'no_scene_{s}']:.0f}"
                            if f"no_scene_{s}" in metrics else ""))
    if "empty_refined" in metrics:
        notes.append(f"empty refined prompts (stepwise UEG) {metrics['empty_refined']:.0f}")
    if metrics.get("truncated_refined"):
        notes.append(f"refined prompts cut at the token budget (stepwise UEG) {metrics['truncated_refined']:.0f}")
    lines.append("")
    lines.append("Accuracy in %: an instance is right when every polling question matches (UEG) or the letter "
                 "is the answer (GEU); unparseable replies and missing images count as failures. "
                 + "; ".join(notes) + ".")
    return "\n".join(lines) + "\n"
