"""EditingScore (the BagelScore/EditingScore paper, section 3 and Table 4): how well a model-internal
score of an edit, ``cos(f(x_s), f(x_t)) * sim_text(p, f^(x_t)) / (rls(x_s, x_t)^2 + eps)``, ranks edits
as raters do.

One module per room, as every evaluation suite:

* :mod:`~unicon.evaluation.editing.data` -- the Edit-1K-like JSONL samples, bad rows refused by file and line;
* :mod:`~unicon.evaluation.editing.metrics` -- the score, its ablations, Kendall tau_b/tau_c, Table 2's
  Pearson matrix and Table 3; pure, no I/O (the choices made where the paper is ambiguous, and its
  normalisation contradiction, are documented there);
* :mod:`~unicon.evaluation.editing.judges` -- Table 3's baseline: a judge rating each edit (the evaluated
  model, or a local VLM, in place of the paper's GPT-based score);
* :mod:`~unicon.evaluation.editing.runner` -- model calls (``image_latents``, ``embed_image``,
  ``embed_text``, optionally ``edit_image``), per-sample records and output files, sharded over ranks;
* :mod:`~unicon.evaluation.editing.plots` -- tau bars and the score-vs-rating scatter;
* :mod:`~unicon.evaluation.editing.suite` -- ``unicon evaluate editing`` and ``eval.editing`` at the end of
  training epochs.
"""
