"""UReason's numbers (Yang et al., sec. 3.2, Tables 2-3) from per-sample records; no I/O, no model.

:class:`UReasonMetric` is a torchmetrics ``Metric`` whose states are per-category **sums** of
per-sample indicators, so torchmetrics' sync (a sum over ranks) gives the counts of the whole
evaluation set as long as every sample is counted on exactly one rank. ``compute()`` returns, with
``N`` the number of instances and ``N_c`` those of category ``c`` (all accuracies in percent):

* ``acc_s{k} = 100 * sum_i 1[verdict_i^k == yes] / N`` for the settings ``k`` = 1 direct, 2
  reasoning-guided, 3 de-contextualized (eq. 4 averaged over instances), and per category
  ``acc_s{k}/<c>`` over ``N_c``. **A missing image, an unparseable judge reply or an empty refined
  prompt is a failure that stays in N.** ``acc_s{k}_excl_missing = 100 * #pass / (N - #missing)``
  is the public reference code's denominator (it drops missing images), for comparison only.
* ``delta_12 = acc_s2 - acc_s1`` and ``delta_23 = acc_s3 - acc_s2`` (eq. 5, consecutive settings),
  overall and per category.
* ``chain_acc = 100 * sum_i 1[chain_verdict_i == yes] / N`` (reasoning-chain accuracy, Table 3),
  overall and per category, present only when chains were judged.
* ``fallback_rate = 100 * #(no marker: last paragraph used as refined prompt) / N`` and
  ``empty_refined_rate = 100 * #(empty refined prompt) / N``.
* counts: ``n``; per setting ``missing_s{k}``, ``unparseable_s{k}``, ``judge_truncated_s{k}``;
  ``trace_truncated`` (reasoning traces that hit the token budget), ``context_cut_s2`` (setting-2
  inputs ``[P, R]`` whose trace was cut from the left to fit the model) and, when chains were
  judged, ``chain_unparseable``.

A ratio over zero instances is NaN. :func:`markdown_table` lays the numbers out as the paper's
Table 2.

A record is one row of ``samples.jsonl`` (:func:`unicon.evaluation.ureason.runner.sample_record`);
the fields read here are ``category``, ``correct_s{k}``, ``image_error_s{k}`` (not ``None`` exactly
when the setting has no image), ``verdict_s{k}``, ``judge_truncated_s{k}``, ``chain_verdict``,
``extraction_rule``, ``trace_truncated`` and ``context_words_cut``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from unicon.data.ureason import CATEGORIES
from unicon.evaluation.category_counts import CategoryCounts

SETTINGS = (1, 2, 3)
SETTING_NAMES = {1: "Direct", 2: "Reasoning-Guided", 3: "De-contextualized"}

#: ``extraction_rule`` of a refined prompt taken from the trace's last paragraph (no marker)
FALLBACK_RULE = "last_paragraph"
#: ``extraction_rule`` of an empty refined prompt
EMPTY_RULE = "empty"

#: the per-category sums kept as metric states
COUNTS = (
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


def record_counts(record: Mapping[str, Any]) -> Counter:
    """The indicators one record adds to :data:`COUNTS` (0/1 each)."""
    c: Counter = Counter(n=1)
    for k in SETTINGS:
        c[f"pass_s{k}"] += bool(record[f"correct_s{k}"])
        c[f"missing_s{k}"] += record[f"image_error_s{k}"] is not None
        c[f"unparseable_s{k}"] += record[f"verdict_s{k}"] == "unparseable"
        c[f"judge_truncated_s{k}"] += bool(record[f"judge_truncated_s{k}"])
    chain = record["chain_verdict"]
    if chain is not None:
        c["chain_judged"] += 1
        c["chain_pass"] += chain == "yes"
        c["chain_unparseable"] += chain == "unparseable"
    c["fallback"] += record["extraction_rule"] == FALLBACK_RULE
    c["empty_refined"] += record["extraction_rule"] == EMPTY_RULE
    c["trace_truncated"] += bool(record["trace_truncated"])
    c["context_cut_s2"] += record["context_words_cut"] > 0
    return c


def ordered_categories(categories: Iterable[str]) -> list[str]:
    """The distinct categories, in the paper's column order (unknown ones after, sorted)."""
    seen = set(categories)
    return [c for c in CATEGORIES if c in seen] + sorted(seen - set(CATEGORIES))


def _pct(num: float, den: float) -> float:
    return 100.0 * num / den if den else float("nan")


class UReasonMetric(CategoryCounts):
    """Per-category sums of :data:`COUNTS`; ``compute()`` returns the metrics of the module docstring."""

    COUNTS = COUNTS
    record_counts = staticmethod(record_counts)
    ordered = staticmethod(ordered_categories)

    def compute(self) -> dict[str, float]:
        per_cat = self.per_category()
        total = {name: sum(values) for name, values in per_cat.items()}
        m: dict[str, float] = {}

        def accuracies(c: Mapping[str, int], suffix: str) -> None:
            for k in SETTINGS:
                m[f"acc_s{k}{suffix}"] = _pct(c[f"pass_s{k}"], c["n"])
            m[f"delta_12{suffix}"] = m[f"acc_s2{suffix}"] - m[f"acc_s1{suffix}"]
            m[f"delta_23{suffix}"] = m[f"acc_s3{suffix}"] - m[f"acc_s2{suffix}"]
            if c["chain_judged"]:
                m[f"chain_acc{suffix}"] = _pct(c["chain_pass"], c["n"])

        accuracies(total, "")
        n = total["n"]
        m["n"] = float(n)
        for k in SETTINGS:
            m[f"acc_s{k}_excl_missing"] = _pct(total[f"pass_s{k}"], n - total[f"missing_s{k}"])
            for f in ("missing", "unparseable", "judge_truncated"):
                m[f"{f}_s{k}"] = float(total[f"{f}_s{k}"])
        m["fallback_rate"] = _pct(total["fallback"], n)
        m["empty_refined_rate"] = _pct(total["empty_refined"], n)
        m["trace_truncated"] = float(total["trace_truncated"])
        m["context_cut_s2"] = float(total["context_cut_s2"])
        if total["chain_judged"]:
            m["chain_unparseable"] = float(total["chain_unparseable"])
        for i, cat in enumerate(self.categories):
            if per_cat["n"][i]:
                accuracies({name: values[i] for name, values in per_cat.items()}, f"/{cat}")
        return m


#: :class:`UReasonMetric` over records in one process (categories: those of the records)
compute_metrics = UReasonMetric.of


def metric_categories(metrics: Mapping[str, float]) -> list[str]:
    """The categories that have per-category accuracies in ``metrics``, in the paper's order."""
    return ordered_categories(k.split("/", 1)[1] for k in metrics if k.startswith("acc_s1/"))


def markdown_table(metrics: Mapping[str, float], categories: Sequence[str]) -> str:
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
        f"{metrics['context_cut_s2']:.0f}."
    )
    return "\n".join(lines) + "\n"
