"""The human cross-consistency study (Telephone-Game paper, section 3.3 and Appendix E) as a web app.

``unicon study create`` turns the drift outputs of several checkpoints on the same seeds into a study
database (:mod:`.inputs` reads the chains, :mod:`.assign` spreads the samples over the annotators,
:mod:`.db` holds the schema and the tokens); ``unicon study serve`` runs the annotation pages
(:mod:`.app`); ``unicon study export`` computes shares, mean ranks, agreement and the correlations
with MCD/MGG/GenEval (:mod:`.export`). :mod:`.annotators` answers a study from the exact ShapesWorld
verifier over HTTP, so a whole study runs in the tests. Nothing else in unicon imports this package.
"""
