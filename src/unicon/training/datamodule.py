"""Training data for Algorithm 1: contrast-set batches mixed with pretraining-mixture batches.

Every training step receives ``{"mixture": <mixture batch>, "contrast": <contrast batch>}``
(a Lightning ``CombinedLoader`` in ``max_size_cycle`` mode: an epoch is as long as the longer
of the two loaders, the shorter one cycles). :class:`~unicon.training.module.ConsistencyModule`
draws γ and uses one of the two; loading both keeps the γ draw the only source of
randomness in what a step does, identical on every rank.

* contrast batches -- CocoCon-schema samples (``unicon.data.cococon.load_cococon``; the
  default file is ``<data.root>/cococon_train.json``) with at most ``data.max_contrast``
  contrast sets each. :func:`collate_contrast` drops samples without any contrast set
  (counted in ``num_skipped``) and pads the ragged candidate lists ``[gold] + contrasts``
  to ``K = 1 + max_b(#contrasts)`` with a bool ``candidate_mask`` (real candidates first).
* mixture batches -- rows of the mixture format (:mod:`unicon.data.mixture`) from
  ``data.source``: ``shapes`` reads the world's ``mixture_train.jsonl``
  (:class:`~unicon.data.mixture.MixtureDataset`), ``coco`` reads COCO captions, VQAv2 and
  RefCOCO/+/g (:func:`unicon.data.coco_mixture.read_coco_mixture`); in the order of
  :class:`MixtureSampler`: ``data.task_weights`` sets how many rows of each task an epoch holds,
  and ``data.batching=by_task`` makes every batch hold a single task.

Images are decoded in the loader workers (``data.num_workers``) and kept as PIL. With the COCO
source, ``image_resize`` (the backend's resize, :func:`unicon.data.coco_mixture.image_resize_for`)
is applied there too, to mixture and contrast images alike (boxes scaled with them), and contrast
samples whose image is missing are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from unicon.data.coco_mixture import read_coco_mixture
from unicon.data.cococon import CocoConData, CocoConSample, load_cococon
from unicon.data.mixture import ImageResize, MixtureDataset, MixtureRowsDataset, collate_mixture, scale_box
from unicon.errors import UserError

log = logging.getLogger(__name__)


class ContrastDataset(Dataset):
    """CocoCon samples with their image, truncated to ``max_contrast`` contrast sets; with
    ``image_resize`` the image is resized here and the sample's gold boxes scaled with it."""

    def __init__(self, data: CocoConData, max_contrast: int, image_resize: ImageResize | None = None):
        if max_contrast < 1:
            raise ValueError(f"data.max_contrast must be >= 1, got {max_contrast}")
        self.data = data
        self.max_contrast = max_contrast
        self.image_resize = image_resize

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        sample: CocoConSample = self.data[idx]
        image = sample.load_image()
        resized = image if self.image_resize is None else self.image_resize(image)
        if resized.size != image.size and sample.boxes:
            sample = dataclasses.replace(sample, boxes=[scale_box(b, image.size, resized.size) for b in sample.boxes])
        return {
            "sample": sample,
            "contrasts": sample.contrast_sets[: self.max_contrast],
            "image": resized,
        }


def collate_contrast(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Keep samples with ≥ 1 contrast set; pad their caption candidate lists with a mask."""
    kept = [e for e in examples if len(e["contrasts"]) >= 1]
    K = 1 + max((len(e["contrasts"]) for e in kept), default=0)
    mask = torch.zeros(len(kept), K, dtype=torch.bool)
    for b, e in enumerate(kept):
        mask[b, : 1 + len(e["contrasts"])] = True
    return {
        "ids": [str(e["sample"].id) for e in kept],
        "samples": [e["sample"] for e in kept],
        "contrasts": [e["contrasts"] for e in kept],
        "images": [e["image"] for e in kept],
        "captions": [[e["sample"].caption] + [c.caption for c in e["contrasts"]] for e in kept],
        "candidate_mask": mask,
        "num_skipped": len(examples) - len(kept),
    }


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(n)`` that depends only on ``(seed, epoch)``.

    Lightning calls ``set_epoch`` at every epoch start, so a run resumed at an epoch boundary
    sees exactly the order the uninterrupted run would have seen. A run resumed mid-epoch sets
    ``skip`` (see :meth:`ConsistencyDataModule.state_dict`): the next pass starts after the
    examples already consumed, so it continues the same order. Under DDP each rank reads its
    share through :class:`RankShare`, which applies the skip to that share.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0
        self.skip = 0  # examples to drop from the start of the next pass only

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def _start_pass(self) -> tuple[torch.Generator, int]:
        """The pass's generator (a function of ``(seed, epoch)``) and the examples to skip (consumed once)."""
        skip, self.skip = self.skip, 0
        return torch.Generator().manual_seed(self.seed * 100_003 + self.epoch), skip

    def __iter__(self):
        g, skip = self._start_pass()
        return iter(torch.randperm(self.n, generator=g).tolist()[skip:])


class MixtureSampler(EpochShuffleSampler):
    """The mixture's epoch order, a function of ``(seed, epoch)`` only.

    Each epoch holds ``m_t = round(w_t · n_t)`` rows of task ``t`` (``w_t`` from
    ``data.task_weights``, default 1): a fresh permutation of the task's rows, repeated when
    ``w_t > 1`` and cut when ``w_t < 1``. With ``by_task`` the rows of each task are cut into
    chunks of ``chunk`` rows (the batch size times the number of ranks; the last chunk of a task
    wraps around to the task's first rows), and the chunks are shuffled: consecutive batches --
    and, as DDP's sampler deals positions to ranks in turn, every rank's batch -- hold one task,
    so a step runs one encoder and one decoder call instead of one per task. Otherwise all rows
    are shuffled together (batches mix tasks); with ``ranks > 1`` each chunk of ``chunk`` rows (one
    step of every rank) is then ordered by task, so that the deal in turn gives every rank the same
    number of each task's rows, give or take one: the ranks' steps cost the same, and neither waits
    for the other at the all-reduce (a rank that drew more of the long think-then-draw rows did)."""

    def __init__(self, tasks: list[str], seed: int = 0, weights: dict[str, float] | None = None,
                 by_task: bool = False, chunk: int = 1, ranks: int = 1):
        self.weights = {t: float((weights or {}).get(t, 1.0)) for t in dict.fromkeys(tasks)}
        self.rows = {t: [i for i, task in enumerate(tasks) if task == t] for t in self.weights}
        self.counts = {t: round(self.weights[t] * len(idx)) for t, idx in self.rows.items()}
        if not any(self.counts.values()):
            raise UserError(f"data.task_weights {dict(weights or {})} leave no mixture row to train on")
        self.by_task, self.chunk, self.ranks = by_task, max(1, int(chunk)), max(1, int(ranks))
        # row -> its task's place in self.rows: the key that orders a chunk by task for the ranks' deal
        self.task_place = {i: k for k, rows in enumerate(self.rows.values()) for i in rows}
        n = sum(-(-m // self.chunk) * self.chunk for m in self.counts.values()) if by_task else sum(self.counts.values())
        super().__init__(n, seed)

    def _task_order(self, task: str, g: torch.Generator) -> list[int]:
        rows, m = self.rows[task], self.counts[task]
        order: list[int] = []
        while len(order) < m:
            order += [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        return order[:m]

    def __iter__(self):
        g, skip = self._start_pass()
        orders = {t: self._task_order(t, g) for t in self.rows if self.counts[t]}
        if not self.by_task:
            flat = [i for order in orders.values() for i in order]
            flat = [flat[i] for i in torch.randperm(len(flat), generator=g).tolist()]
            if self.ranks > 1:
                flat = [i for c in range(0, len(flat), self.chunk)
                        for i in sorted(flat[c: c + self.chunk], key=self.task_place.__getitem__)]
            return iter(flat[skip:])
        chunks = []
        for order in orders.values():
            size = -(-len(order) // self.chunk) * self.chunk
            padded = (order * (-(-size // len(order))))[:size]
            chunks += [padded[i: i + self.chunk] for i in range(0, size, self.chunk)]
        flat = [i for c in torch.randperm(len(chunks), generator=g).tolist() for i in chunks[c]]
        return iter(flat[skip:])


class RankShare(DistributedSampler):
    """Rank ``rank``'s share of a global epoch order: positions ``rank, rank + W, ...`` of the
    order padded to a multiple of ``W`` ranks (as ``DistributedSampler`` pads), minus the first
    ``skip`` of them on a pass resumed mid-epoch (each rank has fetched that many already).

    Sharding here rather than through Lightning's ``DistributedSamplerWrapper`` makes a mid-epoch
    resume exact under DDP: the wrapper would split a global order already shortened by the skip
    while indexing it at its full length (an ``IndexError`` on the first step after a resume).
    Being a ``DistributedSampler``, it is not wrapped again by Lightning.
    """

    def __init__(self, order: EpochShuffleSampler, num_replicas: int, rank: int):
        super().__init__(range(len(order)), num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.order = order
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.order.set_epoch(epoch)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        order = list(self.order)
        order += (order * (-(-self.total_size // max(len(order), 1))))[: self.total_size - len(order)]
        skip, self.skip = self.skip, 0
        return iter(order[self.rank: self.total_size: self.num_replicas][skip:])


class ConsistencyDataModule(L.LightningDataModule):
    """Contrast sets + pretraining mixture for :class:`~unicon.training.module.ConsistencyModule`."""

    def __init__(self, data_cfg: Any, seed: int = 0, with_contrast: bool = True,
                 image_resize: ImageResize | None = None):
        super().__init__()
        self.cfg = data_cfg
        self.seed = seed
        self.image_resize = image_resize  # the COCO source's worker-side resize (module docstring)
        # False when no step can be a consistency update (loss.gamma = 0, pretraining): the contrast
        # sets are then neither read nor loaded, and an epoch is one pass over the mixture
        self.with_contrast = with_contrast
        self.root = Path(data_cfg.root)
        self.contrast: ContrastDataset | None = None
        self.mixture: MixtureRowsDataset | None = None
        self._resume_batches = 0  # set by load_state_dict on a run resumed mid-epoch

    @property
    def contrast_file(self) -> Path:
        if self.cfg.contrast_file:
            return Path(self.cfg.contrast_file)
        if self.cfg.source == "coco":
            raise UserError("data.contrast_file is not set: data.source=coco trains on the contrast sets of "
                            "`unicon build-data cococon` (<out>/cococon.json)")
        return self.root / "cococon_train.json"

    def setup(self, stage: str | None = None) -> None:
        if self.mixture is not None:
            return
        if self.cfg.source == "coco":
            self._setup_coco()
            return
        if not self.root.is_dir():
            raise UserError(f"data.root {self.root} does not exist; build it with `unicon build-data shapes --out {self.root}`")
        if self.with_contrast:
            if not self.contrast_file.is_file():
                raise UserError(f"contrast-set file {self.contrast_file} not found (data.contrast_file)")
            # images_root None = the JSON's folder (ShapesWorld names images relative to the world root)
            data = load_cococon(self.contrast_file, images_root=self.cfg.images_root)
            self.contrast = ContrastDataset(data, self.cfg.max_contrast)
        try:
            self.mixture = MixtureDataset(self.root, "train", tasks=list(self.cfg.tasks),
                                          image_cache_mb=float(self.cfg.image_cache_mb))
        except (FileNotFoundError, ValueError) as e:
            raise UserError(str(e)) from None

    def _setup_coco(self) -> None:
        """COCO captions + VQAv2 + RefCOCO/+/g rows and the builder's contrast sets (images missing
        on disk are skipped and counted, reported once each)."""
        rows, report = read_coco_mixture(self.cfg)
        log.info(report.summary())
        if self.with_contrast:
            if not self.contrast_file.is_file():
                raise UserError(f"data.contrast_file: file not found: {self.contrast_file}")
            # samples of missing images are skipped and counted (load_cococon warns once)
            data = load_cococon(self.contrast_file, images_root=self.cfg.images_root, skip_missing=True)
            if not len(data):
                raise UserError(f"data.contrast_file {self.contrast_file}: no sample has its image under "
                                f"data.images_root={self.cfg.images_root}")
            self.contrast = ContrastDataset(data, self.cfg.max_contrast, self.image_resize)
        self.mixture = MixtureRowsDataset(rows, self.cfg.coco_images, f"COCO mixture ({self.cfg.captions_file})",
                                          float(self.cfg.image_cache_mb), self.image_resize)

    def _loader(self, dataset: Dataset, batch_size: int, collate, sampler: Sampler | None = None) -> DataLoader:
        workers = int(self.cfg.num_workers)
        sampler = sampler or EpochShuffleSampler(len(dataset), self.seed)
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:  # each rank its share (exact mid-epoch resume)
            sampler = RankShare(sampler, trainer.world_size, trainer.global_rank)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            persistent_workers=workers > 0,
            drop_last=False,
        )

    def mixture_sampler(self, ranks: int = 1) -> MixtureSampler:
        """The training mixture's epoch order for ``ranks`` data-parallel ranks (``data.task_weights``,
        ``data.batching``; one chunk is a step's ``batch_size * ranks`` rows). The train loader and
        ``unicon bench`` both draw their batches from it."""
        self.setup("fit")
        return MixtureSampler([r["task"] for r in self.mixture.rows], self.seed, dict(self.cfg.task_weights),
                              by_task=self.cfg.batching == "by_task", chunk=int(self.cfg.batch_size) * ranks,
                              ranks=ranks)

    def train_dataloader(self) -> CombinedLoader:
        self.setup("fit")
        ranks = self.trainer.world_size if self.trainer is not None else 1
        loaders = {"mixture": self._loader(self.mixture, int(self.cfg.batch_size), collate_mixture,
                                           self.mixture_sampler(ranks))}
        if self.with_contrast:
            loaders["contrast"] = self._loader(self.contrast, int(self.cfg.contrast_batch_size), collate_contrast)
        for loader in loaders.values():  # a run resumed mid-epoch continues the epoch's order
            if self._resume_batches and isinstance(loader.sampler, (EpochShuffleSampler, RankShare)) and len(loader):
                loader.sampler.skip = (self._resume_batches % len(loader)) * int(loader.batch_size)
        self._resume_batches = 0
        return CombinedLoader(loaders, mode="max_size_cycle")

    # ---- checkpointed position in the epoch (Lightning saves and restores a datamodule's state) ----
    def state_dict(self) -> dict[str, int]:
        """``batches_used_in_epoch``: the batches of the current epoch already fetched for training
        (0 at an epoch end). In ``max_size_cycle`` mode a shorter loader has cycled, so its position
        is that count modulo its length."""
        trainer = self.trainer
        if trainer is None:
            return {}
        used = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        return {"batches_used_in_epoch": 0 if used >= trainer.num_training_batches else used}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # restored before Lightning asks for the loaders (it does so while configuring the optimizers)
        self._resume_batches = int(state.get("batches_used_in_epoch", 0))
