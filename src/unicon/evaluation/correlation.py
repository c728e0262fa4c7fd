"""Kendall's rank correlation, shared by the suites that set a metric against human ratings
(alignment, editing) and by the study's agreement between annotators.

:func:`kendall` gives τ_b and τ_c (``scipy.stats.kendalltau(variant=...)``) with their two-sided
p-values. Over the n kept pairs, with P the concordant pairs, Q the discordant ones, T_x the pairs
tied in x only and T_y those tied in y only (pairs tied in both count in neither)::

    τ_b = (P − Q) / sqrt((P + Q + T_x)(P + Q + T_y))
    τ_c = 2(P − Q) / (n²(m − 1)/m),   m = min(distinct x values, distinct y values)

**Degenerate cases**: a pair whose x or y is None or not finite is left out and counted in
``missing``; with fewer than two kept pairs, or one side constant over them, τ is undefined and
the τ values and p-values are None (which :mod:`unicon.jsonsafe` writes as ``null``; scipy gives NaN).
"""

from __future__ import annotations

import math
from typing import Any, Sequence


def _usable(v: Any) -> bool:
    return v is not None and math.isfinite(float(v))


def kendall(xs: Sequence[float | None], ys: Sequence[float | None]) -> dict[str, Any]:
    """``{"n", "missing", "tau_b", "p_b", "tau_c", "p_c"}`` of the pairs ``(xs[i], ys[i])`` where both are
    finite (``n`` kept, ``missing`` left out); τ and p None when undefined (the module docstring)."""
    if len(xs) != len(ys):
        raise ValueError(f"kendall needs paired values, got {len(xs)} x and {len(ys)} y")
    keep = [(float(x), float(y)) for x, y in zip(xs, ys) if _usable(x) and _usable(y)]
    out: dict[str, Any] = {"n": len(keep), "missing": len(xs) - len(keep),
                           "tau_b": None, "p_b": None, "tau_c": None, "p_c": None}
    if len(keep) < 2 or len({x for x, _ in keep}) < 2 or len({y for _, y in keep}) < 2:
        return out
    from scipy.stats import kendalltau

    x, y = zip(*keep)
    for variant in ("b", "c"):
        res = kendalltau(x, y, variant=variant)
        if math.isfinite(res.statistic):
            out[f"tau_{variant}"], out[f"p_{variant}"] = float(res.statistic), float(res.pvalue)
    return out
