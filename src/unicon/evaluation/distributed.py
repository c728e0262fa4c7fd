"""How every evaluation suite splits its samples across ranks and gathers what they produced.

One scheme, taken by the epoch-end callbacks and by the standalone ``unicon evaluate`` CLIs alike:

1. :func:`shard_indices` gives this rank its sample indices, from torch's ``DistributedSampler``
   (no shuffling). When ``n`` is not a multiple of the world size, the sampler repeats up to
   ``world - 1`` samples so that every rank runs the same number of batches (collective calls
   inside a model, e.g. DeepSpeed ZeRO-3 parameter gathers, must see the same count on every rank).
2. Each rank evaluates its indices and keeps one record per sample, keyed by the sample's index.
3. :func:`gather_records` collects every rank's records with ``all_gather_object`` (any picklable
   value: strings arrive whole, never cut to a fixed byte width), drops the repeats by index and
   returns them in index order, the same list on every rank.
4. Metrics are computed from that list, so a run on N ranks gives what one process gives.

Without an initialised process group (one process, or a rank-0-only code path) both functions are
the identity, so nothing here needs a special case for ``world_size == 1``.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

import torch.distributed as dist
from torch.utils.data import DistributedSampler

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_indices(n: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
    """This rank's sample indices among ``range(n)`` (see the module docstring, step 1)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if rank is None or world_size is None:
        rank, world_size = rank_and_world()
    if world_size == 1:
        return list(range(n))
    if n == 0:
        return []
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    return list(sampler)


def padding_repeats(n: int, rank: int | None = None, world_size: int | None = None) -> set[int]:
    """The indices of this rank's shard that a lower rank also evaluates: the sampler's padding
    repeats, whose record :func:`gather_records` keeps from that lower rank. A suite that sums
    per-sample states (counts, FID features) leaves them out."""
    if rank is None or world_size is None:
        rank, world_size = rank_and_world()
    lower = {i for r in range(rank) for i in shard_indices(n, r, world_size)}
    return lower & set(shard_indices(n, rank, world_size))


def owned_indices(n: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
    """This rank's :func:`shard_indices` without its padding repeats: every index of ``range(n)`` is
    owned by exactly one rank (the one whose record :func:`gather_records` keeps)."""
    if rank is None or world_size is None:
        rank, world_size = rank_and_world()
    repeats = padding_repeats(n, rank, world_size)
    return [i for i in dict.fromkeys(shard_indices(n, rank, world_size)) if i not in repeats]


def gather_records(records: Mapping[int, T]) -> dict[int, T]:
    """Every rank's ``{index: record}`` merged, repeats dropped, in index order (step 3)."""
    _, world = rank_and_world()
    if world == 1:
        return dict(sorted(records.items()))
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, dict(records))
    merged: dict[int, T] = {}
    for part in parts:
        for index, record in part.items():
            merged.setdefault(index, record)
    return dict(sorted(merged.items()))


def gather_objects(obj: T) -> list[T]:
    """``obj`` from every rank, in rank order (``[obj]`` without a process group)."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, obj)
    return parts
