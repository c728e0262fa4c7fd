"""Seed sets for semantic-drift chains: the (image, caption) pairs or prompts a chain starts from.

* **ShapesWorld** ``drift_seeds.jsonl`` rows ``{"id", "image", "caption", "scene"}`` (``image`` is
  relative to the world root, i.e. the file's folder) -- :func:`load_shapes_seeds`.
* **NoCaps+DOCCI ("ND400")**, the paper's MCD set: ``n`` random (image, caption) pairs from NoCaps
  val (``nocaps_val_4500_captions.json``: COCO-style ``images`` + ``annotations``) plus ``n`` from
  DOCCI (``docci_descriptions.jsonlines`` rows ``{example_id, split, image_file, description}``),
  both read from files the user downloaded -- :func:`nd400_seeds` (``n=200`` gives the paper's 400).
* **GenEval prompts** for MGG (text-first chains only): the short originals or the long rewrites
  -- :func:`geneval_seeds`.

Seed ids become file names in the chain directories (``gen-1/<id>.png``), so they must match
``[A-Za-z0-9_.-]+`` and be unique.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from unicon.data.jsonl import read_jsonl
from unicon.data.geneval import TASKS, GenEvalPrompt, load_geneval
from unicon.errors import UserError

_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class SeedFormatError(UserError, ValueError):
    """A seed file is unusable; the message names the file and line (or key)."""


@dataclass
class DriftSeed:
    """The start of one chain: ``caption`` feeds text-first chains, ``image`` image-first ones."""

    id: str
    caption: str | None = None
    image: Path | None = None
    scene: dict | None = None  # ShapesWorld scene (exact reference similarity)
    geneval: GenEvalPrompt | None = None  # GenEval metadata (MGG)
    source: str = ""  # "shapes" | "nocaps" | "docci" | "geneval"


def check_ids(seeds: Sequence[DriftSeed], where: str) -> None:
    seen = set()
    for s in seeds:
        if not _ID_RE.match(s.id):
            raise SeedFormatError(f"{where}: seed id {s.id!r} is not a safe file name ([A-Za-z0-9_.-]+)")
        if s.id in seen:
            raise SeedFormatError(f"{where}: duplicate seed id {s.id!r}")
        seen.add(s.id)


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    return list(read_jsonl(path, SeedFormatError, "seed file"))


def load_shapes_seeds(path: str | Path, check_images: bool = True) -> list[DriftSeed]:
    """ShapesWorld ``drift_seeds.jsonl`` (or the world root that holds it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "drift_seeds.jsonl"
    seeds = []
    for lineno, row in _read_jsonl(path):
        where = f"{path}:{lineno}"
        for key in ("id", "image", "caption"):
            if key not in row:
                raise SeedFormatError(f"{where}: missing key '{key}'")
        if not isinstance(row["caption"], str) or not row["caption"].strip():
            raise SeedFormatError(f"{where}: 'caption' must be a non-empty string")
        image = path.parent / row["image"]
        if check_images and not image.is_file():
            raise SeedFormatError(f"{where}: image not found: {image}")
        scene = row.get("scene")
        if scene is not None and not isinstance(scene, dict):
            raise SeedFormatError(f"{where}: 'scene' must be an object")
        seeds.append(DriftSeed(id=str(row["id"]), caption=row["caption"], image=image, scene=scene,
                               source="shapes"))
    if not seeds:
        raise SeedFormatError(f"{path}: no seeds")
    check_ids(seeds, str(path))
    return seeds


def load_nocaps(path: str | Path, images_root: str | Path) -> dict[Any, tuple[Path, list[str]]]:
    """NoCaps COCO-style captions -> ``{image_id: (image path, [captions in annotation order])}``."""
    path = Path(path)
    if not path.is_file():
        raise SeedFormatError(f"NoCaps captions file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SeedFormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    for key in ("images", "annotations"):
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise SeedFormatError(f"{path}: expected a COCO-style object with a list '{key}'")
    files = {}
    for i, im in enumerate(data["images"]):
        if not isinstance(im, dict) or "id" not in im or "file_name" not in im:
            raise SeedFormatError(f"{path}: images[{i}] needs 'id' and 'file_name'")
        files[im["id"]] = Path(images_root) / im["file_name"]
    captions: dict[Any, list[str]] = defaultdict(list)
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or "image_id" not in ann or not isinstance(ann.get("caption"), str):
            raise SeedFormatError(f"{path}: annotations[{i}] needs 'image_id' and a string 'caption'")
        if ann["image_id"] not in files:
            raise SeedFormatError(f"{path}: annotations[{i}] refers to unknown image_id {ann['image_id']!r}")
        captions[ann["image_id"]].append(ann["caption"].strip())
    return {k: (files[k], captions[k]) for k in files if captions[k]}


def load_docci(
    path: str | Path, images_root: str | Path, split: str | None = None
) -> list[tuple[str, Path, str]]:
    """DOCCI ``docci_descriptions.jsonlines`` -> ``[(example_id, image, description)]`` (one split or all)."""
    path = Path(path)
    out = []
    for lineno, row in _read_jsonl(path):
        for key in ("example_id", "image_file", "description"):
            if not isinstance(row.get(key), str):
                raise SeedFormatError(f"{path}:{lineno}: missing or non-string '{key}'")
        if split is None or row.get("split") == split:
            out.append((row["example_id"], Path(images_root) / row["image_file"], row["description"].strip()))
    if not out:
        raise SeedFormatError(f"{path}: no DOCCI rows" + (f" with split {split!r}" if split else ""))
    return out


def nd400_seeds(
    nocaps: str | Path, nocaps_images: str | Path, docci: str | Path, docci_images: str | Path,
    n: int = 200, seed: int = 0, docci_split: str | None = "test", check_images: bool = True,
) -> list[DriftSeed]:
    """The paper's NoCaps+DOCCI set: ``n`` random NoCaps pairs + ``n`` random DOCCI pairs.

    NoCaps: ``n`` images drawn without replacement, each with one of its captions drawn at random.
    DOCCI: ``n`` rows drawn without replacement (default split ``test``). Both draws use
    ``random.Random(seed)``, so the set is reproducible. Ids are ``nocaps-<image id>`` and
    ``docci-<example_id>``.
    """
    rng = random.Random(seed)
    nc = load_nocaps(nocaps, nocaps_images)
    dc = load_docci(docci, docci_images, docci_split)
    if n > len(nc) or n > len(dc):
        raise SeedFormatError(f"asked for {n} pairs from each source, but NoCaps has {len(nc)} images "
                              f"and DOCCI {len(dc)} rows")
    seeds = []
    for image_id in rng.sample(sorted(nc, key=str), n):
        image, caps = nc[image_id]
        seeds.append(DriftSeed(id=f"nocaps-{image_id}", caption=rng.choice(caps), image=image,
                               source="nocaps"))
    for example_id, image, description in rng.sample(dc, n):
        seeds.append(DriftSeed(id=f"docci-{example_id}", caption=description, image=image, source="docci"))
    if check_images:
        missing = [s.image for s in seeds if not s.image.is_file()]
        if missing:
            raise SeedFormatError(f"{len(missing)} seed image(s) not found, e.g. {missing[0]}")
    check_ids(seeds, f"{nocaps} + {docci}")
    return seeds


def geneval_seeds(
    path: str | Path, long: bool = False, limit: int | None = None, tasks: tuple[str, ...] | None = TASKS
) -> list[DriftSeed]:
    """Text-only seeds from a GenEval metadata file; ``long`` picks ``detailed_caption`` (BLIP3-o file).

    ``tasks``: allowed tags (default GenEval's six; pass ``None`` for a world with its own tags).
    ``limit`` keeps the first ``limit`` prompts of every task (balanced small sets for callbacks).
    """
    prompts = load_geneval(path, tasks=tasks)
    if limit is not None:
        per: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            if per[p.tag] < limit:
                per[p.tag] += 1
                kept.append(p)
        prompts = kept
    seeds = [DriftSeed(id=p.id, caption=p.text(long), geneval=p, source="geneval") for p in prompts]
    check_ids(seeds, str(path))
    return seeds


def balanced(seeds: Sequence[DriftSeed], n: int) -> list[DriftSeed]:
    """At most ``n`` GenEval seeds, taken round-robin over the tasks (file order within a task)."""
    by_tag: dict[str, list[DriftSeed]] = defaultdict(list)
    for s in seeds:
        by_tag[s.geneval.tag if s.geneval is not None else ""].append(s)
    picked: list[DriftSeed] = []
    queues = list(by_tag.values())
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def is_geneval_file(spec: str | Path) -> bool:
    """Whether ``spec`` is a GenEval metadata file (a ``.jsonl`` whose first row has a ``tag`` key)."""
    path = Path(spec)
    if not path.is_file():
        return False
    rows = _read_jsonl(path)
    return bool(rows) and "tag" in rows[0][1]


def load_seeds(spec: str | Path, long: bool = False) -> list[DriftSeed]:
    """Seeds from a file or folder: a ShapesWorld root / ``drift_seeds.jsonl``, or a GenEval metadata file.

    A ``.jsonl`` file whose first row has a ``tag`` key is read as GenEval metadata (any tag set);
    anything else as drift seeds.
    """
    path = Path(spec)
    if path.is_dir():
        return load_shapes_seeds(path)
    if is_geneval_file(path):
        return geneval_seeds(path, long=long, tasks=None)
    return load_shapes_seeds(path)
