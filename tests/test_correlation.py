"""The shared Kendall helper (:func:`unicon.evaluation.correlation.kendall`): scipy's tau_b and tau_c on
an example with ties, None in every degenerate case, and its users (alignment, editing's Table 3, the
study's pairwise agreement) reading it with their own keys."""

from __future__ import annotations

import json
import math

import pytest
from scipy.stats import kendalltau

from unicon import jsonsafe
from unicon.evaluation.correlation import kendall

UNDEFINED = {"tau_b": None, "p_b": None, "tau_c": None, "p_c": None}


def test_kendall_equals_scipy_with_ties_on_both_sides():
    xs = [0.1, 0.3, 0.3, 0.9, 0.5, 0.5, 0.2]
    ys = [1, 2, 3, 4, 2, 2, 1]
    k = kendall(xs, ys)
    assert list(k) == ["n", "missing", "tau_b", "p_b", "tau_c", "p_c"]
    assert k["n"] == 7 and k["missing"] == 0
    for variant in ("b", "c"):
        want = kendalltau(xs, ys, variant=variant)
        assert k[f"tau_{variant}"] == want.statistic and k[f"p_{variant}"] == want.pvalue
    assert k["tau_b"] != k["tau_c"]  # the ties make the two differ


def test_the_docstring_equations():
    # P, Q, T_x, T_y by hand: tau_b = (P - Q) / sqrt((P+Q+T_x)(P+Q+T_y)), tau_c = 2(P - Q) / (n^2 (m-1)/m)
    xs, ys = [1, 2, 2, 3], [1, 1, 2, 3]
    p = q = tx = ty = 0
    for i in range(4):
        for j in range(i + 1, 4):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            p += dx * dy > 0
            q += dx * dy < 0
            tx += dx == 0 and dy != 0
            ty += dy == 0 and dx != 0
    m = min(len(set(xs)), len(set(ys)))
    k = kendall(xs, ys)
    assert k["tau_b"] == pytest.approx((p - q) / math.sqrt((p + q + tx) * (p + q + ty)), abs=1e-12)
    assert k["tau_c"] == pytest.approx(2 * (p - q) / (4 ** 2 * (m - 1) / m), abs=1e-12)


@pytest.mark.parametrize("xs, ys, n, missing", [
    ([], [], 0, 0),                                             # no pair
    ([0.4], [1.0], 1, 0),                                       # one pair
    ([0.5, 0.5, 0.5], [1.0, 2.0, 3.0], 3, 0),                   # a constant side (x)
    ([0.1, 0.2, 0.3], [2.0, 2.0, 2.0], 3, 0),                   # a constant side (y)
    ([0.1, None, float("nan")], [1.0, 2.0, 3.0], 1, 2),         # one pair left once the missing are dropped
    ([0.1, 0.2, 0.3, 0.4], [1.0, None, float("inf"), 1.0], 2, 2),  # constant once the missing are dropped
])
def test_degenerate_cases_are_none(xs, ys, n, missing):
    assert kendall(xs, ys) == {"n": n, "missing": missing, **UNDEFINED}


def test_missing_values_are_dropped_and_counted_on_either_side():
    xs = [0.1, None, 0.3, 0.3, 0.9, float("nan"), 0.7, 0.2]
    ys = [1, 2, 2, 3, 4, 4, None, float("-inf")]
    k = kendall(xs, ys)
    assert k["n"] == 4 and k["missing"] == 4
    assert k["tau_b"] == kendalltau([0.1, 0.3, 0.3, 0.9], [1, 2, 3, 4], variant="b").statistic
    assert k["tau_c"] == kendalltau([0.1, 0.3, 0.3, 0.9], [1, 2, 3, 4], variant="c").statistic
    with pytest.raises(ValueError, match="paired values"):
        kendall([0.1, 0.2], [1.0])


def test_alignment_keeps_its_keys():
    from unicon.evaluation.alignment.metrics import summarize

    recs = [{"rating": r, "scores": {"m": s}} for s, r in ((0.1, 1), (0.4, 2), (None, 3), (0.2, 3))]
    out = summarize(recs, ["m"])["m"]
    assert out == kendall([0.1, 0.4, None, 0.2], [1, 2, 3, 3]) and out["missing"] == 1


def test_editing_table3_with_a_constant_column_reads_null():
    from unicon.evaluation.editing.metrics import CORRELATED, kendall_row, summarize
    from unicon.evaluation.editing.runner import markdown_table

    recs = [{**{k: float(i) for k in CORRELATED}, "score": 2.0, "ratings": {"overall": i / 4}} for i in range(5)]
    results = summarize(recs, {})
    row = results["table3"]["rows"]["score"]
    assert row == {"tau_b": None, "tau_c": None, "p_value": None, "n": 5}
    assert results["kendall"]["score"]["overall"] == row
    assert results["score_direction"]["overall"] == "undefined" and results["agrees_with_paper"]["overall"] is None
    human = results["table3"]["rows"]["human"]
    assert list(human) == ["tau_b", "tau_c", "p_value", "n"] and human["tau_b"] == pytest.approx(1.0)
    assert results["kendall"]["rls"]["overall"] == kendall_row([float(i) for i in range(5)], [i / 4 for i in range(5)])
    written = jsonsafe.loads_strict(jsonsafe.dumps({"results": results}))["results"]
    assert written["table3"]["rows"]["score"] == row
    assert written["metrics"]["tau_b/score/overall"] is None
    assert '"tau_b": null' in jsonsafe.dumps({"results": results}, indent=2)
    assert "| EditingScore | n/a | n/a | 5 |" in markdown_table(results)
    assert "| EditingScore (tau_b) | n/a |" in markdown_table(results)
    json.dumps(results["table3"], allow_nan=False)  # the table itself holds no NaN


def test_study_pairwise_tau_is_the_helpers_tau_b():
    from unicon.study.export import ranking_agreement

    ranks = {"ann1": [1, 2, 3], "ann2": [1, 3, 2], "ann3": [3, 2, 1]}
    rows = [{"section": "s", "sample": 0, "annotator": a, "model": m, "rank": r}
            for a, rs in ranks.items() for m, r in zip("abc", rs)]
    got = ranking_agreement(rows, "s", list("abc"))
    pairs = [("ann1", "ann2"), ("ann1", "ann3"), ("ann2", "ann3")]
    want = sum(kendalltau(ranks[a], ranks[b]).statistic for a, b in pairs) / 3
    assert got["units"] == 1 and got["kendall_tau_pairwise"] == pytest.approx(want, abs=1e-12)
