"""Semantic drift (the Telephone Game paper): chains of alternating I2T and T2I generations, scored
by MCD (embedding similarity to the chain's input) and MGG (GenEval over generations).

Rooms, lowest first (each imports only the ones above it):

* (:mod:`unicon.jsonsafe` writes its results files: non-finite values as null with a reason);
* :mod:`.geneval` -- GenEval rules and the Telephone-Game reference MGG rules (pure), and the
  detectors that feed them (OWLv2, Mask2Former, ShapesWorld);
* :mod:`.metrics` -- MCD, MGG, the decay fit and the logger scalars: pure functions of per-seed
  records, with their equations; no files, models or ranks;
* :mod:`.plots` -- figures (``matplotlib.figure.Figure``, no backend switch) and their logging;
* :mod:`.runner` -- the chain runner: the on-disk layout (:class:`.runner.ChainLayout`), the
  resumable journals, markers and repairs, scoring of chains into per-seed records, the split
  of seeds across ranks and :func:`.runner.evaluate_drift`, which ties it all together;
* :mod:`.suite` -- ``unicon evaluate drift`` and the epoch-end evaluation (``eval.drift``), and the
  chain arguments of ``unicon bench chains`` (:mod:`unicon.bench.chains`).
"""
