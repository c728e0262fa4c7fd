"""CocoCon cross-task consistency evaluation (Maharana et al., sections 3 and 4.3).

One module per room, the same rooms as every evaluation suite:

* :mod:`.metrics` -- pure functions, no model and no file I/O: Eq. 1 per sample and contrast,
  C_k (Eq. 2), ρ_rank, ranking accuracies, VQA answer normalisation and soft accuracy, box IoU,
  CIDEr, the generative accuracies and the flat logger scalars;
* :mod:`.runner` -- the model calls: scoring and generating over samples
  (:class:`~.runner.CocoConEvaluator`, :func:`~.runner.evaluate_model`, sharded across ranks with
  :mod:`unicon.evaluation.distributed`), and ``results.json`` / ``per_sample.jsonl``;
* :mod:`.suite` -- ``unicon evaluate cococon`` and ``eval.cococon`` at the end of training epochs,
  with the W&B sample table;
* :mod:`.plots` -- the paper's Fig. 5 (C_k by k, C_k against accuracy).

The samples come from :func:`unicon.data.cococon.load_cococon`.
"""
