"""The shared state of the suites whose metric is a set of per-category counts (UReason, RealUnify).

:class:`CategoryCounts` is a torchmetrics ``Metric`` holding one ``[len(categories)]`` long tensor per
count name, summed over ranks (``dist_reduce_fx="sum"``), so a sharded or DDP evaluation gives the
same totals as one process by construction. A suite subclasses it with its ``COUNTS`` (the names),
its ``record_counts(record) -> {name: int}`` (what one per-sample record adds), its ``ordered``
(the categories in the suite's order) and its ``compute()``, which reads :meth:`per_category`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import torch
from torchmetrics import Metric

from unicon.evaluation.distributed import gather_records, metric_sync_kwargs, owned_indices


class CategoryCounts(Metric):
    """Per-category sums of :attr:`COUNTS` over the records given to :meth:`update`.

    ``categories`` fixes the state shape, so every rank (and shard) must pass the same list. Under
    DDP each sample's record must be given to ``update`` on one rank only.
    """

    full_state_update = False
    #: the count names (one state tensor each), set by the subclass
    COUNTS: ClassVar[tuple[str, ...]] = ()
    #: ``record -> {count name: value}`` of one per-sample record, set by the subclass
    record_counts: ClassVar[Callable[[Mapping[str, Any]], Mapping[str, int]]]
    #: ``categories -> the distinct ones in the suite's order`` (the rows of the states), set by the subclass
    ordered: ClassVar[Callable[[Iterable[str]], list[str]]]

    def __init__(self, categories: Sequence[str], **kwargs: Any):
        super().__init__(**kwargs)
        self.categories = tuple(categories)
        self._row = {c: i for i, c in enumerate(self.categories)}
        for name in self.COUNTS:
            self.add_state(name, default=torch.zeros(len(self.categories), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, records: Iterable[Mapping[str, Any]]) -> None:
        counts = torch.zeros(len(self.COUNTS), len(self.categories), dtype=torch.long)
        index = {name: k for k, name in enumerate(self.COUNTS)}
        for record in records:
            if record["category"] not in self._row:
                raise ValueError(f"record of category {record['category']!r}; the metric knows {self.categories}")
            row = self._row[record["category"]]
            for name, value in type(self).record_counts(record).items():
                counts[index[name], row] += int(value)
        for name, column in zip(self.COUNTS, counts.to(self.device)):
            setattr(self, name, getattr(self, name) + column)

    def per_category(self) -> dict[str, list[int]]:
        """``{count name: [value per category]}`` (the synced state)."""
        return {name: getattr(self, name).tolist() for name in self.COUNTS}

    @classmethod
    def of(cls, records: Sequence[Mapping[str, Any]], categories: Sequence[str] | None = None) -> dict[str, float]:
        """``compute()`` over ``records`` in one process (categories: those of the records)."""
        metric = cls(categories or cls.ordered(r["category"] for r in records))
        metric.update(records)
        return metric.compute()

    @classmethod
    def gathered(cls, instances: Sequence, mine: Sequence[int], samples: Sequence, record: Callable,
                 save_images: Callable, out: Path | None, device) -> tuple[dict[str, float], list[dict]]:
        """The metrics, and every instance's record in instance order, of a run whose rank evaluated the
        ``instances`` at the indices ``mine`` (:func:`~unicon.evaluation.distributed.shard_indices`) into
        ``samples``. The rank records (``record(sample, save_images(out, sample))``; without ``out``, no
        image is saved) and counts only the samples it owns, so that the sampler's padding repeats are run
        by every rank (the same number of model calls) but recorded once; the counts are summed over the
        ranks (or shards), on ``device``, and the records of every rank gathered."""
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        by_index = dict(zip(mine, samples))
        records = {i: record(by_index[i], save_images(out, by_index[i]) if out is not None else {})
                   for i in owned_indices(len(instances))}
        metric = cls(cls.ordered(inst.category for inst in instances), **metric_sync_kwargs()).to(device)
        metric.update(records.values())
        return metric.compute(), list(gather_records(records).values())
