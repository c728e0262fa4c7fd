"""Strict JSON for results files (drift.json, table2.json, ...): no bare ``NaN`` / ``Infinity``.

Python's :func:`json.dumps` writes non-finite floats as the bare tokens ``NaN`` and ``Infinity``,
which are not JSON (RFC 8259) and which strict readers (``jq``, JavaScript's ``JSON.parse``,
``json.loads(..., parse_constant=...)``) reject. :func:`finite` replaces every non-finite float by
``null``; for a headline metric (:data:`HEADLINE`) that is null it adds ``"<key>_reason"`` (unless
the producer already gave one), and :func:`dumps` writes with ``allow_nan=False`` so a non-finite
value can never slip through.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

#: top-level keys whose value is a headline number (drift.json's): a null one carries a reason
HEADLINE = ("MCD_avg", "SDR_avg", "MGG", "MGG_micro")


def finite(obj: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, numpy / torch scalars) with every non-finite float as None."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a 0-d tensor / array
        return finite(obj.item())
    return obj


def with_reasons(report: dict[str, Any], headline: tuple[str, ...] = HEADLINE) -> dict[str, Any]:
    """``finite(report)`` plus ``"<key>_reason"`` for each headline key of ``report`` that is null."""
    out = finite(report)
    for key in headline:
        if key in out and out[key] is None and not out.get(f"{key}_reason"):
            raw = report[key]
            out[f"{key}_reason"] = "not computed" if raw is None else f"non-finite value ({raw!r})"
    return out


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` of ``with_reasons(obj)`` (a dict) or ``finite(obj)``, refusing non-finite floats."""
    safe = with_reasons(obj) if isinstance(obj, dict) else finite(obj)
    return json.dumps(safe, allow_nan=False, **kwargs)


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects the non-JSON constants ``NaN``, ``Infinity`` and ``-Infinity``."""

    def refuse(constant: str):
        raise ValueError(f"non-JSON constant {constant} in a results file")

    return json.loads(text, parse_constant=refuse)
