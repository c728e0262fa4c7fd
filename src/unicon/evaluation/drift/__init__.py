"""Semantic drift (the Telephone Game paper): chains of alternating I2T and T2I generations, scored
by MCD (embedding similarity to the chain's input) and MGG (GenEval over generations).

The modules are the rooms of every suite (docs/layout.md) plus :mod:`.geneval` (the GenEval and
Telephone-Game MGG rules, and their detectors); each imports only the ones before it in the order
geneval, metrics, report, plots, runner, suite.
"""
