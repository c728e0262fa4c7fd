"""Semantic-drift metrics (MCD, MGG, decay fits) as pure functions of per-chain records.

Nothing here reads files, calls a model or talks to other ranks: :mod:`.runner` turns chains into
one record per seed, gathers them across ranks, and hands the full list (in seed order) to these
functions, so N ranks give exactly what one process gives.

Chains (Telephone-Game paper, section 3). With ``G`` generations and a unified model ``UM``:

* **text-first**:  ``T0 -T2I-> I1 -I2T-> T2 -T2I-> I3 ...``
* **image-first**: ``I0 -I2T-> T1 -T2I-> I2 -I2T-> T3 ...``

**MCD** (Eq. 1-2). For a distance mapping ``delta`` (``t2t``, ``t2i``: text-first, even / odd
generations; ``i2i``, ``i2t``: image-first, even / odd generations) and seed set ``D``::

    S_delta(g) = 1/|D| sum_{d in D} cos(e(inp_d), e(M_d^(g)))     (inp_d = generation-0 item of chain d)
    MCD_delta  = 1/|G_delta| sum_{g in G_delta} S_delta(g)         (G_delta = {g in 1..G where delta is defined})
    MCD_avg    = mean of MCD_delta over the mappings computed (two for text-only seeds)

Eq. 2 writes ``1/G sum_{g=1..G}``; each mapping only exists at every other generation, so the
mean runs over those (``ceil(G/2)`` odd or ``floor(G/2)`` even generations). Each embedder that
supports a mapping gets its own S/MCD (``by_embedder``); the headline value of a mapping uses the
first available of :data:`PREFERRED` (sentence embedder for t2t, DINO for i2i, CLIP across
modalities).

**SDR** (semantic drift rate). The paper's text defines only MCD and MGG; SDR comes from the
authors' public reference code (``semantic-drift/mcd-sdr.py`` of
github.com/mollahsabbir/Semantic-Drift-in-Unified-Models). For each mapping it fits, by
unconstrained least squares (scipy ``curve_fit``, Levenberg-Marquardt)::

    S_delta(g) ~ a_delta * exp(-b_delta * g) + c_delta       over g in G_delta

from the start point ``(a, b, c) = (1, 0.1, 0)`` with at most 5000 function evaluations and no
bound on any parameter (``b`` may come out negative: similarity rising with g; a nearly linear
curve may send ``a`` and ``c`` to large values of opposite signs with ``b`` near 0, as it does in
the reference). :func:`fit_decay` uses exactly these settings. The reference then prints, as "SDR", the mean of the fitted triples
``(a, b, c)`` over its four mappings. unicon reports, per mapping and over the mappings:

* ``decay[delta]``: the fit ``{a, b, c, rmse}`` (or ``{error}``), also as ``SDR_abc[delta] = {a, b, c}``;
* ``SDR_abc_mean = {a, b, c}``: the mean of the fitted triples, the reference's printed "SDR";
* ``SDR[delta] = b_delta`` (the drift *rate*) and ``SDR_avg``: the mean of ``b_delta``, which is
  the ``b`` of ``SDR_abc_mean``.

Differences from the reference: (1) a mapping's similarity curve comes from the first available
embedder of :data:`PREFERRED` (the reference hard-codes MPNet for t2t, DINO for i2i and CLIP for
t2i / i2t; unicon's "text" embedder is MPNet or MiniLM); (2) a fit that fails (fewer than 3
points, i.e. G < 5 / 6, non-finite similarities, or no convergence within 5000 evaluations) is
recorded as ``{error}`` and the means run over the mappings whose fit succeeded, where the
reference script stops with an exception; (3) when scipy cannot estimate the covariance (e.g.
exactly 3 points) the fit is kept with a ``warning``, as the reference keeps it (it only prints
the warning); (4) the reference also fits the mean of the four curves against ``g = 1..n`` for a
plot only; unicon does not. When no fit succeeds, ``SDR_avg`` and ``SDR_abc_mean`` are None with
``SDR_avg_reason`` saying why (drift.json holds no bare NaN, :mod:`unicon.jsonsafe`).

**G.** Every average above runs over generations ``1..G``: runs compare only at equal G. The paper
uses ``G = 20`` (:data:`PAPER_G`); the epoch-end callback's default 4 is a cheap training-time
signal, and ``drift.json`` marks whether a run's G is the paper's.

**MGG** (section 3.2). GenEval on the images of every image-bearing generation ``g in {1, 3, 5, ...}``
of text-first chains started from GenEval prompts::

    acc_t(g)   = 1/|D_t| sum_{d in D_t} correct_d(g)               (D_t: the prompts of task t)
    GenEval(g) = 1/|T| sum_t acc_t(g)                              (GenEval's summary: mean over tasks)
    MGG        = mean of GenEval(g) over those generations

``MGG_micro`` replaces ``GenEval(g)`` by the mean over all images (the paper's public script).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from unicon.config import DRIFT_CHAINS
from unicon.evaluation.drift.geneval import summarize

CHAINS = DRIFT_CHAINS
#: the paper's number of generations per chain
PAPER_G = 20
#: mapping -> (chain, parity of its generations, source modality, target modality)
MAPPINGS = {
    "t2t": ("text-first", 0, "text", "text"),
    "t2i": ("text-first", 1, "text", "image"),
    "i2i": ("image-first", 0, "image", "image"),
    "i2t": ("image-first", 1, "image", "text"),
}
#: mapping -> embedders whose S/MCD is the headline value, first available wins
PREFERRED = {"t2t": ("text", "clip", "scene"), "t2i": ("clip", "scene"), "i2i": ("dino", "clip", "scene"),
             "i2t": ("clip", "scene")}


def without_clip(clip: str, world: str, embedders: Sequence[str]) -> str:
    """The line a drift run writes when the default CLIP model (``clip``) was never trained: which
    headline MCDs another of ``embedders`` (the ones loaded) measures instead, and the command that
    trains the CLIP on the world at ``world``."""
    instead: dict[str, list[str]] = {}
    for mapping, preferred in PREFERRED.items():
        usable = [e for e in preferred if e == "clip" or e in embedders]
        if usable[0] == "clip":
            instead.setdefault(usable[1] if len(usable) > 1 else None, []).append(mapping)
    measured = ", ".join(f"MCD {', '.join(mappings)} is measured with the {e} embedder instead of CLIP" if e
                         else f"MCD {', '.join(mappings)} is not measured" for e, mappings in instead.items())
    return (f"drift: no CLIP model at the default {clip}, so {measured} and no drift/clip/* metric is logged; "
            f"train the world's CLIP (minutes on a CPU): python -m unicon.embedders.clip --train-shapes {world} "
            f"--out {clip}")


def modality(chain: str, g: int) -> str:
    """``"text"`` or ``"image"``: what generation ``g`` of ``chain`` holds."""
    first = "text" if chain == "text-first" else "image"
    return first if g % 2 == 0 else ("image" if first == "text" else "text")


def mapping_generations(mapping: str, generations: int) -> list[int]:
    """``G_delta``: the generations in ``1..generations`` at which ``mapping`` is defined."""
    parity = MAPPINGS[mapping][1]
    return [g for g in range(1, generations + 1) if g % 2 == parity]


#: start point and evaluation budget of the reference code's ``curve_fit`` (module docstring)
DECAY_P0 = (1.0, 0.1, 0.0)
DECAY_MAXFEV = 5000


def decay(g, a, b, c):
    """``a exp(-b g) + c``: the reference code's decay model."""
    return a * np.exp(-b * np.asarray(g, dtype=float)) + c


def fit_decay(gens: Sequence[float], values: Sequence[float]) -> dict[str, Any]:
    """Least-squares fit of ``S(g) = a exp(-b g) + c`` as the reference code fits it (module docstring).

    Returns ``{"a", "b", "c", "rmse"}`` (plus ``"warning"`` when scipy could not estimate the
    covariance), or ``{"error": reason}`` with fewer than 3 points, non-finite values, or when the
    fit does not converge or gives non-finite parameters."""
    x, y = np.asarray(gens, dtype=float), np.asarray(values, dtype=float)
    if len(x) < 3:
        return {"error": f"needs >= 3 generations, got {len(x)}"}
    if not np.all(np.isfinite(y)):
        return {"error": "non-finite similarities"}
    from scipy.optimize import OptimizeWarning, curve_fit

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OptimizeWarning)
            (a, b, c), _ = curve_fit(decay, x, y, p0=DECAY_P0, maxfev=DECAY_MAXFEV)
    except (RuntimeError, ValueError, TypeError) as e:
        return {"error": f"curve_fit failed: {str(e).splitlines()[0]}"}
    if not np.all(np.isfinite([a, b, c])):
        return {"error": f"curve_fit gave non-finite parameters ({a}, {b}, {c})"}
    rmse = float(np.sqrt(np.mean((decay(x, a, b, c) - y) ** 2)))
    fit = {"a": float(a), "b": float(b), "c": float(c), "rmse": rmse}
    notes = [str(w.message).splitlines()[0] for w in caught if issubclass(w.category, OptimizeWarning)]
    if notes:
        fit["warning"] = notes[0]
    return fit


def mcd(similarities: Sequence[Mapping[str, Mapping[str, Sequence[float]]]], generations: int) -> dict[str, Any]:
    """S_delta(g), MCD_delta per embedder, the headline MCD and the decay fits (module docstring).

    ``similarities[d][embedder][mapping]`` holds chain ``d``'s cosines ``cos(e(inp_d), e(M_d^(g)))``
    at ``g in G_delta`` (:func:`mapping_generations`), one entry per seed in seed order; every seed
    has the same embedders and mappings. Returns ``{"S": {mapping: {g: value}}, "MCD": {mapping:
    value}, "MCD_avg", "embedder": {mapping: name}, "by_embedder": {name: {mapping: {"S", "MCD",
    "per_chain"}}}, "decay": {mapping: fit}, "SDR": {mapping: b}, "SDR_avg", "SDR_abc": {mapping: {a, b, c}},
    "SDR_abc_mean": {a, b, c}}``. ``SDR_avg`` and ``SDR_abc_mean`` are None, with ``SDR_avg_reason``,
    when no fit succeeded; ``MCD_avg`` is None, with ``MCD_avg_reason``, when no mapping was computed.
    """
    if not similarities:
        raise ValueError("MCD needs at least one chain")
    names = list(similarities[0])
    by_emb: dict[str, dict] = {}
    for name in names:
        by_emb[name] = {}
        for mapping in MAPPINGS:
            if mapping not in similarities[0][name]:
                continue
            gens = mapping_generations(mapping, generations)
            sims = torch.tensor([chain[name][mapping] for chain in similarities], dtype=torch.float32)
            if sims.shape[1] != len(gens):
                raise ValueError(f"{name}/{mapping}: {sims.shape[1]} similarities per chain for generations {gens}")
            S = {g: float(v) for g, v in zip(gens, sims.mean(0).tolist())}
            by_emb[name][mapping] = {"S": S, "MCD": float(np.mean(list(S.values()))),
                                     "per_chain": [[round(v, 6) for v in row] for row in sims.tolist()]}
    result: dict[str, Any] = {"S": {}, "MCD": {}, "embedder": {}, "decay": {}, "by_embedder": by_emb}
    for mapping in MAPPINGS:
        for name in PREFERRED[mapping] + tuple(names):
            if mapping in by_emb.get(name, {}):
                entry = by_emb[name][mapping]
                result["S"][mapping], result["MCD"][mapping] = entry["S"], entry["MCD"]
                result["embedder"][mapping] = name
                result["decay"][mapping] = fit_decay(list(entry["S"]), list(entry["S"].values()))
                break
    if result["MCD"]:
        result["MCD_avg"] = float(np.mean(list(result["MCD"].values())))
    else:
        result["MCD_avg"] = None
        result["MCD_avg_reason"] = "no embedder supports any mapping of the chains computed"
    fits = {m: fit for m, fit in result["decay"].items() if "b" in fit}
    result["SDR"] = {m: fit["b"] for m, fit in fits.items()}
    result["SDR_abc"] = {m: {k: fit[k] for k in "abc"} for m, fit in fits.items()}
    if fits:
        result["SDR_avg"] = float(np.mean(list(result["SDR"].values())))
        result["SDR_abc_mean"] = {k: float(np.mean([fit[k] for fit in fits.values()])) for k in "abc"}
    else:
        failed = "; ".join(f"{m}: {fit.get('error')}" for m, fit in result["decay"].items())
        result["SDR_avg"] = result["SDR_abc_mean"] = None
        result["SDR_avg_reason"] = f"no decay fit succeeded ({failed or 'no mapping computed'})"
    return result


def mgg(tags: Sequence[str], correct: Sequence[Mapping[int, bool]]) -> dict[str, Any]:
    """GenEval per image generation and MGG (module docstring).

    ``tags[d]`` is prompt ``d``'s GenEval task, ``correct[d][g]`` whether its chain's image at
    generation ``g`` passed GenEval, one entry per seed in seed order. Returns ``{"per_generation":
    {g: {"tasks", "counts", "overall", "overall_micro", "correct"}}, "MGG", "MGG_micro"}``.
    """
    if not correct or not correct[0]:
        raise ValueError("MGG needs at least one image generation of one chain")
    if len(tags) != len(correct):
        raise ValueError(f"{len(tags)} GenEval tags for {len(correct)} chains")
    per_gen = {}
    for g in sorted(correct[0]):
        column = [chain[g] for chain in correct]
        per_gen[g] = {**summarize(tags, column), "correct": column}
    return {
        "per_generation": per_gen,
        "MGG": float(np.mean([v["overall"] for v in per_gen.values()])),
        "MGG_micro": float(np.mean([v["overall_micro"] for v in per_gen.values()])),
    }


def drift_metrics(report: Mapping[str, Any], prefix: str = "drift") -> dict[str, float]:
    """Flat scalars of a ``drift.json`` report for the loggers: ``MCD_avg``, ``MCD_<mapping>``,
    ``<embedder>/MCD_<mapping>``, ``drift_rate_<mapping>`` (SDR: the fitted ``b``), ``SDR_avg``, ``MGG``,
    ``MGG_micro`` and ``MGG_<task>`` (the task's accuracy averaged over the image generations)."""
    m: dict[str, float] = {}
    if "mcd" in report:
        if report.get("MCD_avg") is not None:
            m[f"{prefix}/MCD_avg"] = report["MCD_avg"]
        for k, v in report["MCD"].items():
            m[f"{prefix}/MCD_{k}"] = v
        for name, per in report["mcd"]["by_embedder"].items():
            for k, v in per.items():
                m[f"{prefix}/{name}/MCD_{k}"] = v["MCD"]
        for k, fit in report["mcd"]["decay"].items():
            if "b" in fit:
                m[f"{prefix}/drift_rate_{k}"] = fit["b"]
        if report["mcd"].get("SDR") and report["mcd"].get("SDR_avg") is not None:
            m[f"{prefix}/SDR_avg"] = report["mcd"]["SDR_avg"]
    if "mgg" in report:
        m[f"{prefix}/MGG"] = report["MGG"]
        m[f"{prefix}/MGG_micro"] = report["MGG_micro"]
        gens = report["mgg"]["per_generation"]
        tasks = {t for v in gens.values() for t in v["tasks"]}
        for t in sorted(tasks):
            m[f"{prefix}/MGG_{t}"] = float(np.mean([v["tasks"][t] for v in gens.values() if t in v["tasks"]]))
    return m
