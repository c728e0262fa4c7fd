"""``unicon bench``: throughput benchmarks that print one JSON object, with every ratio measured side by
side in the same run (these machines are noisy; a bench compares, it does not time in isolation).

* :mod:`unicon.bench.scoring` -- ``unicon bench scoring``: batched vs naive likelihood scoring of
  contrast sets (any backend), with the float32 agreement bound;
* :mod:`unicon.bench.training` -- ``unicon bench train`` (consistency vs standard updates, the
  training loop's overhead, the rank loss's per-task gradient regime) and ``unicon bench pretrain``
  (examples/s, model FLOPs, the share of a matmul peak, data-parallel ranks);
* :mod:`unicon.bench.chains` -- ``unicon bench chains``: batched vs one-at-a-time drift chains;
* :mod:`unicon.bench.help` -- ``unicon bench help``: every command's ``--help`` in a fresh process
  (seconds, modules imported), against the budget of one second;
* :mod:`unicon.bench.first_batch` -- ``unicon bench first-batch``: seconds from process start to the
  first model batch of ``unicon evaluate cococon``, as the code is and with Lightning imported first.

The CocoCon builder's bench (``unicon bench build-cococon``) stays beside the builder in
``data_builders/cococon.py``, which sits outside the ``unicon`` package.

The benches sit above training and evaluation: they may import anything in ``unicon`` but ``cli``.
"""
