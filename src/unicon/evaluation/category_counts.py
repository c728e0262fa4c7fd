"""The shared state of the suites whose metric is a set of per-category counts (UReason, RealUnify).

:class:`CategoryCounts` is a torchmetrics ``Metric`` holding one ``[len(categories)]`` long tensor per
count name, summed over ranks (``dist_reduce_fx="sum"``), so a sharded or DDP evaluation gives the
same totals as one process by construction. A suite subclasses it with its ``COUNTS`` (the names),
its ``record_counts(record) -> {name: int}`` (what one per-sample record adds) and its ``compute()``,
which reads :meth:`per_category`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import torch
from torchmetrics import Metric


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
