"""UReason (Yang et al.): does a unified model's reasoning reach the pixels?

One module per room, the same rooms as every evaluation suite:

* :mod:`~unicon.evaluation.ureason.metrics` -- the accuracies of the three settings (direct,
  reasoning-guided, de-contextualized), their gains, chain accuracy, per category: a torchmetrics
  ``Metric`` over per-sample records and the Table 2 layout; pure, no I/O;
* :mod:`~unicon.evaluation.ureason.runner` -- model calls over instances (images, reasoning traces,
  refined prompts), judging, per-sample records and output files, sharded over ranks;
* :mod:`~unicon.evaluation.ureason.judges` -- the judges (VLM, reasoning-chain LLM, ShapesWorld's
  exact verifier) and their strict answer parsing;
* :mod:`~unicon.evaluation.ureason.suite` -- ``unicon evaluate ureason`` and ``eval.ureason`` at the end
  of training epochs.

The suite has no figures, hence no ``plots`` module. Instances are loaded by :mod:`unicon.data.ureason`.
"""
