"""RealUnify (Shi et al.): does unification help? Understanding Enhances Generation (UEG) and
Generation Enhances Understanding (GEU), each direct and stepwise.

One module per room, the same rooms as every evaluation suite:

* :mod:`~unicon.evaluation.realunify.prompts` -- the paper's Tables 7-13, verbatim, and their filling;
* :mod:`~unicon.evaluation.realunify.data` -- the instances of ``--data`` (a ShapesWorld root, the
  public release's GEU parquet files, a UEG JSONL file), malformed rows refused by file and row;
* :mod:`~unicon.evaluation.realunify.judges` -- the UEG polling judges (ShapesWorld's exact one, a
  local VLM) and the strict multiple-choice letter grammar;
* :mod:`~unicon.evaluation.realunify.metrics` -- accuracies per category, axis and overall, direct and
  stepwise, their difference; a torchmetrics ``Metric`` of summed states; pure, no I/O;
* :mod:`~unicon.evaluation.realunify.runner` -- model calls over instances, judging, per-sample records
  and output files, sharded over ranks;
* :mod:`~unicon.evaluation.realunify.plots` -- the accuracy bars;
* :mod:`~unicon.evaluation.realunify.suite` -- ``unicon evaluate realunify`` and ``eval.realunify`` at the
  end of training epochs.
"""
