"""Correlations with human ratings, and the reference-based caption metrics (no unified model; BERTScore
loads its text encoder through :mod:`.bertscore`).

* :func:`summarize`: the summary of ``alignment.json``: per metric, Kendall's τ_b and τ_c
  (:func:`unicon.evaluation.correlation.kendall`) of its scores against the ratings, over the pairs
  where the metric has a score (a ``decode`` failure, a pair without references for a reference
  metric: left out and counted in ``missing``);
* :func:`reference_metrics`: per-pair BLEU-1, BLEU-4, ROUGE-L, METEOR, CIDEr-D, SPICE (pycocoevalcap)
  and BERTScore (:mod:`.bertscore`) of each caption against its references (the baselines of the
  BagelScore paper's Table 1). They are computed over the **whole** set at once (CIDEr's document
  frequencies are corpus statistics), so a sharded run computes them in the merge, from the gathered
  records. With ``c`` the caption's tokens and ``r`` ranging over its references:

  - BLEU-n (pycocoevalcap's per-sentence score, ``option="closest"``):
    ``BP * (prod_{k<=n} p_k)^(1/n)``, ``p_k`` the k-gram precision with each k-gram's count clipped
    to its largest count in one reference, ``BP = min(1, exp(1 - r*/|c|))``, ``r*`` the reference
    length closest to ``|c|`` (pycocoevalcap adds 1e-15 to every match count and 1e-9 to every
    k-gram count so that an empty caption scores 0);
  - ROUGE-L (pycocoevalcap): ``P = max_r LCS(c, r) / |c|``, ``R = max_r LCS(c, r) / |r|`` (each
    maximised on its own, possibly over different references), ``(1 + b^2) P R / (R + b^2 P)`` with
    ``b = 1.2`` (0 when P or R is 0);
  - METEOR and SPICE run pycocoevalcap's Java jars and are skipped, with the reason recorded, when
    ``java`` is not on the PATH; SPICE also needs the Stanford CoreNLP 3.6.0 jars that pycocoevalcap
    downloads into its ``spice/lib`` on first use (no download is attempted here: without them SPICE
    is skipped with the reason; :func:`spice_unavailable`). SPICE is the F-score of the caption's
    scene-graph tuples against the union of the references' (Anderson et al., 2016; its "All" F);
  - BERTScore: F_BERT of :mod:`.bertscore` against the best reference, with a local all-MiniLM-L6-v2
    (not the published roberta-large: its values are not comparable with published ones).

  Captions are tokenised with the PTB tokenizer when ``java`` is there, else lower-cased with
  punctuation dropped (``tokenizer`` in the summary says which); BERTScore reads the raw texts;
* :func:`clip_scores`: CLIP-S = w·max(cos(image, caption), 0) and RefCLIP-S = the harmonic mean of
  CLIP-S and max(max_r cos(caption, reference r), 0), w = 2.5 (Hessel et al., 2021, eqs. 1-2). Hessel
  et al. embed every caption and reference with the prefix "A photo depicts " (:data:`HESSEL_PREFIX`;
  their section 3 and their released ``clipscore.py``); the runner prefixes the texts as its
  ``clip_prefix`` setting says (:func:`unicon.evaluation.alignment.runner.resolve_clip_prefix`).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from unicon.evaluation.cococon.metrics import tokenize_captions
from unicon.evaluation.correlation import kendall

#: CLIPScore's rescaling weight w (Hessel et al., 2021)
CLIP_W = 2.5
#: the text Hessel et al. put before every caption and reference they embed with CLIP
HESSEL_PREFIX = "A photo depicts "
#: the reference-based caption metrics
REFERENCE_METRICS = ("bleu1", "bleu4", "rouge_l", "meteor", "cider", "spice", "bertscore")
#: what SPICE needs beside its own jar: Stanford CoreNLP 3.6.0, in pycocoevalcap's ``spice/lib``
SPICE_CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


def spice_unavailable() -> str | None:
    """Why SPICE cannot run here (None: it can): ``java`` missing from the PATH, or the Stanford CoreNLP
    jars (:data:`SPICE_CORENLP_JARS`) missing from pycocoevalcap's ``spice/lib`` (pycocoevalcap's
    ``Spice()`` would download them; nothing is downloaded here)."""
    if shutil.which("java") is None:
        return "java is not on the PATH (pycocoevalcap's SPICE runs a Java jar)"
    import pycocoevalcap.spice as spice_pkg

    lib = Path(spice_pkg.__file__).parent / "lib"
    missing = [j for j in SPICE_CORENLP_JARS if not (lib / j).is_file()]
    if missing:
        return (f"the Stanford CoreNLP 3.6.0 jars SPICE parses with are not installed ({', '.join(missing)} "
                f"missing from {lib}); pycocoevalcap downloads them on first use, which needs network: "
                "python -c 'from pycocoevalcap.spice.get_stanford_models import get_stanford_models as g; g()'")
    return None


def spice_scores(gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]]) -> tuple[list[float | None], str | None]:
    """Per key of ``gts`` (in its order) SPICE's "All" F (None where SPICE gives none), and None; or
    ``([], why)`` when the jar fails. Runs pycocoevalcap's ``spice-1.0.jar`` as its ``Spice`` class does
    (``-subset -silent``, 8 GB heap), with its input and output in a temporary folder and without
    ``-cache`` (pycocoevalcap keeps its parse cache and temporary files inside its installed package)."""
    import pycocoevalcap.spice as spice_pkg

    folder = Path(spice_pkg.__file__).parent
    keys = list(gts)
    with tempfile.TemporaryDirectory(prefix="unicon-spice-") as tmp:
        inp, out = Path(tmp) / "input.json", Path(tmp) / "output.json"
        inp.write_text(json.dumps([{"image_id": str(k), "test": res[k][0], "refs": list(gts[k])} for k in keys]))
        cmd = ["java", "-jar", "-Xmx8G", "spice-1.0.jar", str(inp), "-out", str(out), "-subset", "-silent"]
        try:
            subprocess.run(cmd, cwd=folder, check=True, capture_output=True, text=True)
            rows = json.loads(out.read_text())
        except subprocess.CalledProcessError as e:
            tail = (e.stderr or e.stdout or "").strip().splitlines()
            return [], f"SPICE failed: java exited with {e.returncode}" + (f" ({tail[-1]})" if tail else "")
        except (OSError, ValueError) as e:
            return [], f"SPICE failed: {e}"
    by_id = {str(r["image_id"]): r["scores"]["All"]["f"] for r in rows}
    values: list[float | None] = []
    for k in keys:
        try:
            v = float(by_id.get(str(k)))
        except (TypeError, ValueError):
            v = float("nan")
        values.append(v if math.isfinite(v) else None)
    return values, None


#: the keys of :func:`reference_metrics`' notes that describe the run rather than a skipped metric
NOTE_INFO = ("tokenizer", "bertscore_model")


def reference_metrics(captions: Sequence[str], references: Sequence[Sequence[str]],
                      names: Sequence[str] = REFERENCE_METRICS,
                      bertscore=None) -> tuple[dict[str, list[float | None]], dict[str, Any]]:
    """Per-pair scores ``{metric: [score or None per pair]}`` (None: the pair has no references, or
    SPICE gave none) and notes: ``{metric: why it was skipped}``, ``"tokenizer": "ptb"|"simple"`` (when a
    pycocoevalcap metric ran) and ``"bertscore_model"`` (the scorer's
    :meth:`~.bertscore.BertScorer.describe`, when BERTScore ran). ``bertscore``: the
    :class:`~.bertscore.BertScorer` (default: the bundled all-MiniLM-L6-v2, loaded once)."""
    notes: dict[str, Any] = {}
    scores: dict[str, list[float | None]] = {}
    names = [n for n in REFERENCE_METRICS if n in names]
    if not names:
        return scores, notes
    keys = [i for i, refs in enumerate(references) if refs]
    if not keys:
        for n in names:
            notes[n] = "no pair has references"
        return scores, notes

    def per_pair(values) -> list[float | None]:
        out: list[float | None] = [None] * len(captions)
        for i, v in zip(keys, values):
            out[i] = None if v is None or not math.isfinite(float(v)) else float(v)
        return out

    coco = [n for n in names if n != "bertscore"]
    if coco:
        gts, res, notes["tokenizer"] = tokenize_captions({i: references[i] for i in keys},
                                                          {i: captions[i] for i in keys})
        java = notes["tokenizer"] == "ptb"
        # pycocoevalcap iterates over gts.keys(): keep the same order for every scorer
        gts = {i: gts[i] for i in keys}
        res = {i: res[i] if res[i] and res[i][0] else [""] for i in keys}
        bleu = None
        for name in coco:
            if name == "meteor" and not java:
                notes[name] = "java is not on the PATH (pycocoevalcap's METEOR runs a Java jar)"
                continue
            if name in ("bleu1", "bleu4"):
                if bleu is None:
                    from pycocoevalcap.bleu.bleu import Bleu

                    _, bleu = Bleu(4).compute_score(gts, res, verbose=0)
                values = bleu[0 if name == "bleu1" else 3]
            elif name == "rouge_l":
                from pycocoevalcap.rouge.rouge import Rouge

                _, values = Rouge().compute_score(gts, res)
            elif name == "meteor":
                from pycocoevalcap.meteor.meteor import Meteor

                meteor = Meteor()
                try:
                    _, values = meteor.compute_score(gts, res)
                finally:
                    close = getattr(meteor, "close", None)
                    if close is not None:
                        close()
            elif name == "spice":
                why = spice_unavailable()
                if why is None:
                    values, why = spice_scores(gts, res)
                if why is not None:
                    notes[name] = why
                    continue
            else:
                from pycocoevalcap.cider.cider import Cider

                _, values = Cider().compute_score(gts, res)
            scores[name] = per_pair(np.asarray(values, dtype=float).tolist() if name != "spice" else values)
    if "bertscore" in names:
        if bertscore is None:
            from unicon.evaluation.alignment.bertscore import default_scorer

            bertscore = default_scorer()
        prf = bertscore.score([captions[i] for i in keys], [references[i] for i in keys])
        scores["bertscore"] = per_pair([None if x is None else x[2] for x in prf])
        notes["bertscore_model"] = bertscore.describe()
    return scores, notes


def clip_scores(image_emb: torch.Tensor, caption_emb: torch.Tensor,
                reference_embs: Sequence[torch.Tensor | None], w: float = CLIP_W) -> tuple[list[float], list[float | None]]:
    """``(CLIP-S, RefCLIP-S)`` per pair from L2-normalised embeddings (``reference_embs[i]``: ``[R_i, D]``
    or None without references, whose RefCLIP-S is None)."""
    cos = (image_emb.double() * caption_emb.double()).sum(-1)
    clip_s = (w * cos.clamp(min=0)).tolist()
    ref_s: list[float | None] = []
    for c, cap, refs in zip(clip_s, caption_emb.double(), reference_embs):
        if refs is None or len(refs) == 0:
            ref_s.append(None)
            continue
        r = max(float((refs.double() @ cap).max()), 0.0)
        ref_s.append(0.0 if c + r == 0 else 2 * c * r / (c + r))
    return clip_s, ref_s


def summarize(records: Sequence[Mapping[str, Any]], metric_names: Sequence[str]) -> dict[str, Any]:
    """Per metric: Kendall τ_b/τ_c against ``rating`` (:func:`~unicon.evaluation.correlation.kendall`),
    plus for ``bagelscore_decode`` its ``failures`` and ``failure_rate`` (unparseable replies among the
    pairs it scored)."""
    ratings = [r["rating"] for r in records]
    out: dict[str, Any] = {}
    for name in metric_names:
        scores = [r["scores"].get(name) for r in records]
        out[name] = kendall(scores, ratings)
        if name == "bagelscore_decode":
            fails = out[name]["missing"]
            out[name]["failures"] = fails
            out[name]["failure_rate"] = fails / len(records) if records else None
    return out


def flat_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """``{"<metric>/tau_b": ..., "<metric>/tau_c": ..., "<metric>/n": ..., "bagelscore_decode/failure_rate"}``
    (None values left out) for the loggers."""
    flat = {}
    for name, s in summary.items():
        for key in ("tau_b", "tau_c", "n", "failure_rate"):
            if s.get(key) is not None:
                flat[f"{name}/{key}"] = float(s[key])
    return flat


def markdown_table(summary: Mapping[str, Any], n_pairs: int, skipped: Mapping[str, int],
                   not_run: Mapping[str, str] | None = None, bertscore_model: Mapping[str, Any] | None = None) -> str:
    """The τ table (× 100) with a line per metric; below it the pairs, the skipped ratings, the metrics
    not run and why, and which model BERTScore used."""
    lines = ["| metric | τ_b | τ_c | n | not scored |", "| --- | --- | --- | --- | --- |"]

    def f(v):
        return "–" if v is None else f"{100 * v:.1f}"

    for name, s in summary.items():
        extra = f"{s['missing']}" + (f" ({100 * s['failure_rate']:.1f}% unparseable)" if s.get("failure_rate") else "")
        lines.append(f"| {name} | {f(s['tau_b'])} | {f(s['tau_c'])} | {s['n']} | {extra} |")
    lines.append("")
    lines.append(f"τ × 100 against the human ratings; {n_pairs} pairs"
                 + (f", skipped: {', '.join(f'{k} {v}' for k, v in sorted(skipped.items()) if v)}" if any(skipped.values()) else "")
                 + ".")
    for name, why in (not_run or {}).items():
        lines.append(f"\n{name}: not run ({why}).")
    if bertscore_model:
        lines.append(f"\nbertscore: F_BERT with {bertscore_model['model']}, layer {bertscore_model['layer']}; "
                     f"{bertscore_model['note']}.")
    return "\n".join(lines) + "\n"
