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

The same ranks can also run as separate jobs: ``unicon evaluate <suite> --shard i/n`` is rank ``i``
of ``n`` (:func:`sharded_run`: the same partition, its collective parts saved to disk), and
``--merge`` (:func:`merged_run`) replays the collective calls over the saved parts, so the merged
files equal an ``n``-rank run and one process, byte for byte.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, TypeVar

import torch.distributed as dist
from torch.utils.data import DistributedSampler

from unicon.errors import UserError
from unicon.evaluation.shard_parts import dump_part, load_part

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one; ``(i, n)`` in
    shard ``i/n`` and ``(0, n)`` in the merge of ``n`` shards (:func:`sharded_run`, :func:`merged_run`)."""
    v = _VIRTUAL
    if v is not None:
        return (v.shard.index if v.shard is not None else 0), v.world
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _this_rank(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` as given, else this process's; None in a merge (it evaluates nothing itself)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    return None if _merging() else rank_and_world()


def shard_indices(n: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
    """This rank's sample indices among ``range(n)`` (see the module docstring, step 1)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if (resolved := _this_rank(rank, world_size)) is None:
        return []
    rank, world_size = resolved
    return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=False))


def owned_indices(n: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
    """This rank's :func:`shard_indices` without its padding repeats: every index of ``range(n)`` is
    owned by exactly one rank (the one whose record :func:`gather_records` keeps). The sampler deals
    position ``p`` of ``range(n)`` followed by its padding to rank ``p % world_size``, so a rank owns
    ``range(rank, n, world_size)``."""
    if (resolved := _this_rank(rank, world_size)) is None:
        return []
    rank, world_size = resolved
    return list(range(rank, n, world_size))


def padding_repeats(n: int, rank: int | None = None, world_size: int | None = None) -> set[int]:
    """The indices of this rank's shard that a lower rank also evaluates: the sampler's padding
    repeats, whose record :func:`gather_records` keeps from that lower rank. A suite that sums
    per-sample states (counts, FID features) leaves them out."""
    if (resolved := _this_rank(rank, world_size)) is None:
        return set()
    return set(shard_indices(n, *resolved)) - set(owned_indices(n, *resolved))


def gather_objects(obj: T) -> list[T]:
    """``obj`` from every rank, in rank order (``[obj]`` without a process group; a shard: ``[obj]``;
    a merge: every shard's ``obj``)."""
    if _VIRTUAL is not None:
        return _VIRTUAL.collective(obj)
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, obj)
    return parts


def gather_records(records: Mapping[int, T]) -> dict[int, T]:
    """Every rank's ``{index: record}`` merged, repeats dropped, in index order (step 3)."""
    merged: dict[int, T] = {}
    for part in gather_objects(dict(records)):  # a shard: its own; a merge: every shard's
        for index, record in part.items():
            merged.setdefault(index, record)
    return dict(sorted(merged.items()))


# ---------------------------------------------------------------------------------------------
# Sharded runs: the same scheme, with the ranks run as separate jobs (``--shard i/n``) and the
# gathering done afterwards by a merge (``--merge``) that reads what every shard saved.
# ---------------------------------------------------------------------------------------------
#
# A shard ``i/n`` is rank ``i`` of a world of ``n``: it evaluates ``shard_indices(N, i, n)`` (the
# DistributedSampler partition, padding repeats included), and every collective call the suite makes
# (``gather_records``, ``gather_objects``, a torchmetrics state sync through :func:`metric_sync_kwargs`)
# saves this rank's part as ``<folder>/shard-<i>-of-<n>/collective-<k>.json`` (``k``: the call's
# position; the format of :mod:`unicon.evaluation.shard_parts`) and returns what a world of one
# would. The shard writes no final output (:func:`writes_outputs` is False). ``done.json`` marks a
# finished shard: its number of collective calls, the settings key and any extra information (e.g.
# its seconds).
#
# The merge runs the same suite code with no sample of its own (``shard_indices`` is empty): each
# collective call ``k`` returns the parts every shard saved at call ``k``, in shard order, exactly
# what ``all_gather_object`` / torchmetrics' sync return on ``n`` ranks. So the merge computes the
# metrics and writes the files from the same inputs as an ``n``-rank run, hence as one process.
# The parts are strict JSON (:mod:`unicon.evaluation.shard_parts`): reading a shard folder runs no
# code, whoever wrote it, and a file that is not such a part is refused with its name.

@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``--shard i/n``, 0-based)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, flag: str = "--shard") -> "Shard":
        parts = str(text).split("/")
        try:
            index, count = (int(p) for p in parts)
        except ValueError:
            raise UserError(f"{flag} {text!r}: expected i/n with integers, e.g. 0/4") from None
        if count < 1 or not 0 <= index < count:
            raise UserError(f"{flag} {text}: need n >= 1 and 0 <= i < n")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def folder(self, root: str | Path) -> Path:
        return Path(root) / f"shard-{self.index}-of-{self.count}"


@dataclass
class _Virtual:
    """The state of a sharded run (``shard`` set) or a merge (``parts``: every shard's folder)."""

    folder: Path
    world: int
    shard: Shard | None = None
    parts: list[Path] = field(default_factory=list)
    calls: int = 0

    def collective(self, obj: Any) -> list[Any]:
        """Collective call number ``self.calls``: save (shard) or load every shard's part (merge)."""
        k, self.calls = self.calls, self.calls + 1
        name = f"collective-{k:03d}.json"
        if self.shard is not None:
            dump_part(obj, self.folder / name)
            return [obj]
        out = []
        for part in self.parts:
            path = part / name
            if not path.is_file():
                pickled = path.with_suffix(".pkl")
                if pickled.is_file():
                    raise UserError(f"merge: {part} holds {pickled.name}, a pickle, and no {name}: the merge reads "
                                     "no pickle (unpickling can run code); rerun that shard")
                raise UserError(f"merge: {path} is missing: the merge made more collective calls than the "
                                 "shards did (were they run with the same settings?)")
            out.append(load_part(path))
        return out


_VIRTUAL: _Virtual | None = None


def _merging() -> bool:
    return _VIRTUAL is not None and _VIRTUAL.shard is None


def _check_can_start() -> None:
    """A sharded run or a merge runs alone: no process group, no other sharded run around it."""
    if dist.is_available() and dist.is_initialized():
        raise UserError("--shard / --merge run as separate jobs; they cannot be combined with a process group "
                         "(torchrun / srun with several tasks)")
    if _VIRTUAL is not None:
        raise RuntimeError("sharded runs do not nest")


@contextmanager
def sharded_run(root: str | Path, shard: Shard, key: Mapping[str, Any]) -> Iterator[dict]:
    """Run the block as shard ``shard``; collective parts go to ``shard.folder(root)``. ``key``: the
    settings every shard and the merge must share (checked by :func:`merged_run`). Yields a dict
    whose content is stored in ``done.json`` under ``"extra"`` when the block finishes."""
    global _VIRTUAL
    _check_can_start()
    folder = shard.folder(root)
    if folder.exists():  # a rerun of this shard: its previous parts are replaced
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    extra: dict = {}
    _VIRTUAL = _Virtual(folder=folder, world=shard.count, shard=shard)
    try:
        yield extra
        done = {"shard": str(shard), "collectives": _VIRTUAL.calls, "key": dict(key), "extra": extra}
        (folder / "done.json").write_text(json.dumps(done, indent=1, default=str) + "\n")  # key order kept
    finally:
        _VIRTUAL = None


def _read_done(path: Path) -> dict:
    """A shard's ``done.json``; a file that is not one (not JSON, missing fields) is a :class:`UserError`
    naming it."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"merge: {path} is unreadable ({str(e).splitlines()[0][:120]}); rerun that shard") from None
    fields = {"shard": str, "collectives": int, "key": dict, "extra": dict}
    if not isinstance(info, dict) or any(not isinstance(info.get(k), t) for k, t in fields.items()):
        raise UserError(f"merge: {path} is not the done.json a shard writes (it needs {', '.join(fields)}); "
                         "rerun that shard")
    return info


def finished_shards(root: str | Path, key: Mapping[str, Any]) -> list[dict]:
    """The ``done.json`` of every shard under ``root``, in shard order; a missing or unfinished
    shard, shards of different counts, or a shard run with other settings than ``key`` is a
    :class:`UserError` naming it."""
    root = Path(root)
    found = sorted(root.glob("shard-*-of-*"))
    if not found:
        raise UserError(f"merge: no shard folder under {root} (run the shards with --shard i/n first)")
    counts = {p.name.rsplit("-of-", 1)[1] for p in found}
    if len(counts) != 1:
        raise UserError(f"merge: {root} holds shards of different counts ({', '.join(sorted(counts))}); "
                         "remove the folders of the old split")
    count = int(counts.pop())
    done = []
    for i in range(count):
        path = Shard(i, count).folder(root) / "done.json"
        if not path.is_file():
            raise UserError(f"merge: shard {i}/{count} has not finished (no {path}); run or rerun it")
        info = _read_done(path)
        want = json.loads(json.dumps(dict(key), sort_keys=True, default=str))
        if info["key"] != want:
            diff = sorted(k for k in set(info["key"]) | set(want) if info["key"].get(k) != want.get(k))
            raise UserError(f"merge: shard {i}/{count} ({path}) was run with other settings: "
                             + ", ".join(f"{k}={info['key'].get(k)!r} (merge: {want.get(k)!r})" for k in diff))
        done.append(info)
    calls = {d["collectives"] for d in done}
    if len(calls) != 1:
        raise UserError(f"merge: the shards under {root} made different numbers of collective calls {sorted(calls)}")
    return done


@contextmanager
def merged_run(root: str | Path, key: Mapping[str, Any]) -> Iterator[list[dict]]:
    """Run the block as the merge of the finished shards under ``root`` (see the section comment);
    yields their ``done.json`` contents. The block must make the shards' collective calls, no more,
    no fewer."""
    global _VIRTUAL
    _check_can_start()
    done = finished_shards(root, key)
    count = len(done)
    _VIRTUAL = _Virtual(folder=Path(root), world=count,
                        parts=[Shard(i, count).folder(root) for i in range(count)])
    try:
        yield done
        if _VIRTUAL.calls != done[0]["collectives"]:
            raise RuntimeError(f"merge made {_VIRTUAL.calls} collective calls, the shards "
                               f"{done[0]['collectives']}: the suite's code path differs between them")
    finally:
        _VIRTUAL = None


def writes_outputs() -> bool:
    """Whether this process writes a suite's final files: rank 0 of a process group (or one
    process), a merge; never a shard."""
    if _VIRTUAL is not None:
        return _VIRTUAL.shard is None
    return rank_and_world()[0] == 0


def _virtual_sync(tensor, group=None) -> list:
    """torchmetrics ``dist_sync_fn`` of a sharded run or merge (one collective per state tensor)."""
    if _VIRTUAL.shard is not None:
        _VIRTUAL.collective(tensor.detach().cpu())
        return [tensor]
    return [t.to(tensor.device) for t in _VIRTUAL.collective(None)]


def metric_sync_kwargs() -> dict[str, Any]:
    """Keyword arguments for a torchmetrics ``Metric`` built by a suite: under a sharded run or a
    merge, its states are reduced over the shards' saved states (torchmetrics' own reduction);
    otherwise nothing (torchmetrics syncs over the process group as usual)."""
    if _VIRTUAL is None:
        return {}
    return {"dist_sync_fn": _virtual_sync, "distributed_available_fn": lambda: True}
