"""Image-text alignment against human ratings: BagelScore (the BagelScore/EditingScore paper, §3.1) of
any :class:`~unicon.models.base.UnifiedModel`, with the paper's Table 1 baselines (CLIPScore,
RefCLIPScore, BLEU-1, BLEU-4, ROUGE-L, METEOR, CIDEr-D, SPICE, BERTScore) side by side, as Kendall τ_b
and τ_c (docs/alignment.md).

One module per room, the same rooms as every evaluation suite:

* :mod:`~unicon.evaluation.alignment.prompts` -- the rating scales: the paper's Flickr8K-CF prompt,
  verbatim, and its 1-4 form for Flickr8K-Expert (ours), their values and the strict grammar of a
  decoded rating;
* :mod:`~unicon.evaluation.alignment.bagelscore` -- BagelScore's two modes (``expected``, ``decode``);
* :mod:`~unicon.evaluation.alignment.data` -- the pairs of ``--data`` (Flickr8K JSON in the CLIPScore
  layout, JSONL, a ShapesWorld root); bad ratings skipped and counted, bad rows refused by file and row;
* :mod:`~unicon.evaluation.alignment.judges` -- the optional VLM judge (``vlm:<dir>``);
* :mod:`~unicon.evaluation.alignment.metrics` -- Kendall τ, CLIP-S / RefCLIP-S, the reference metrics
  (pycocoevalcap's, its Java jars for METEOR and SPICE);
* :mod:`~unicon.evaluation.alignment.bertscore` -- BERTScore's greedy matching with the local
  all-MiniLM-L6-v2;
* :mod:`~unicon.evaluation.alignment.runner` -- model calls, records, output files, sharded over ranks;
* :mod:`~unicon.evaluation.alignment.plots` -- each metric against the rating;
* :mod:`~unicon.evaluation.alignment.suite` -- ``unicon evaluate alignment`` and the evaluation at the end
  of training epochs (``eval.alignment``).
"""
