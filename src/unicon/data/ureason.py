"""Loader for UReason prompts (the public release, the full set, and ShapesWorld's own).

Release format (Yang et al., "UReason", sec. 2 and the public repository): one JSONL row per
instance, ``{"id", "prompt", "expect_en", "category"}``, in two files per category:

* ``direct_<cat>.jsonl`` -- the setting-1 prompt (draw directly);
* ``<cat>.jsonl``        -- the think-then-refine prompt used by settings 2 and 3, which asks the
  model to end its reasoning with ``refined prompt: ...`` (or ``Final Scene Prompt: ...``).

Both files of a category hold the same ids; :func:`load_ureason` pairs them by ``id`` into one
:class:`UReasonInstance`. The public release has 5 categories x 100 = 500 instances
(``../shared/data/ureason``).

The full 2,000-instance set is split into ``test`` (1,500) and ``testmini`` (500). Its on-disk
layout is not public yet, so two layouts are accepted for ``split=...``: a sub-directory
``<root>/<split>/`` with the same file pairs, or rows carrying a ``"split"`` field in ``<root>``.

ShapesWorld's reasoning prompts (``<world>/ureason/``, written by ``unicon build-data shapes``)
use the same schema plus ``"target_scene"`` (a scene dict) for the exact checker, with the
categories arithmetic, attribute, spatial and code; :func:`load_shapes_ureason` reads them.
:func:`load_instances` takes either kind of directory, :func:`subset` a round-robin subset.

Criteria: in the public release 20 pairs (code/attribute) differ only by a doubled space between
the two files' ``expect_en``; criteria are compared and stored whitespace-normalised, and a real
difference is an error naming both files and lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

#: categories of the public release (paper sec. 2.1)
CATEGORIES = ("code", "arithmetic", "spatial", "attribute", "text")
SPLITS = ("test", "testmini")
REQUIRED_KEYS = ("id", "prompt", "expect_en", "category")


class UReasonFormatError(UserError, ValueError):
    """A UReason file does not follow the schema; the message names the file and line."""


@dataclass(frozen=True)
class UReasonInstance:
    """One benchmark instance: both prompts and the ground-truth criterion ``C``."""

    id: int | str
    category: str
    direct_prompt: str  # setting 1
    prompt: str  # think-then-refine prompt, settings 2 and 3
    expect_en: str  # criterion C, checked by the judge (whitespace-normalised)
    split: str | None = None
    target_scene: dict | None = None  # ShapesWorld only: the scene the criterion describes
    source: str = ""  # "<think file>:<line>", for error messages and the per-sample output

    @property
    def key(self) -> str:
        """A file-name-safe unique key, ``<category>_<id>``."""
        return f"{self.category}_{self.id}"


def _normalise(text: str) -> str:
    return " ".join(text.split())


def read_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``[(line_number, row), ...]`` of a JSONL file; blank lines are skipped.

    Malformed JSON, a non-object row, or a row missing one of ``id/prompt/expect_en/category``
    raises :class:`UReasonFormatError` naming ``file:line``.
    """
    path = Path(path)
    rows = []
    for lineno, row in read_jsonl(path, UReasonFormatError, "UReason file"):
        missing = [k for k in REQUIRED_KEYS if row.get(k) in (None, "")]
        if missing:
            raise UReasonFormatError(f"{path}:{lineno}: row is missing {', '.join(missing)}")
        for k in ("prompt", "expect_en", "category"):
            if not isinstance(row[k], str):
                raise UReasonFormatError(f"{path}:{lineno}: '{k}' must be a string, got {type(row[k]).__name__}")
        if not isinstance(row["id"], (int, str)) or isinstance(row["id"], bool):
            raise UReasonFormatError(f"{path}:{lineno}: 'id' must be an int or a string")
        rows.append((lineno, row))
    return rows


def _index(path: Path, rows: list[tuple[int, dict]], category: str, split: str | None) -> dict:
    out: dict[Any, tuple[int, dict]] = {}
    for lineno, row in rows:
        if split is not None and row.get("split", split) != split:
            continue
        if row["category"] != category:
            raise UReasonFormatError(
                f"{path}:{lineno}: category '{row['category']}' does not match the file's category '{category}'"
            )
        if row["id"] in out:
            raise UReasonFormatError(f"{path}:{lineno}: duplicate id {row['id']!r} (first on line {out[row['id']][0]})")
        out[row["id"]] = (lineno, row)
    return out


def discover_categories(root: str | Path) -> list[str]:
    """Categories that have a ``direct_<cat>.jsonl`` in ``root``, in the paper's order first."""
    names = sorted(p.name[len("direct_") : -len(".jsonl")] for p in Path(root).glob("direct_*.jsonl"))
    order = {c: i for i, c in enumerate(CATEGORIES)}
    return sorted(names, key=lambda c: (order.get(c, len(order)), c))


def load_category(root: str | Path, category: str, split: str | None = None) -> list[UReasonInstance]:
    """Pair ``direct_<category>.jsonl`` with ``<category>.jsonl`` by id (ordered as the think file)."""
    root = Path(root)
    direct_path, think_path = root / f"direct_{category}.jsonl", root / f"{category}.jsonl"
    direct = _index(direct_path, read_rows(direct_path), category, split)
    think = _index(think_path, read_rows(think_path), category, split)
    only_direct = sorted(set(direct) - set(think), key=str)
    only_think = sorted(set(think) - set(direct), key=str)
    if only_direct or only_think:
        raise UReasonFormatError(
            f"{root}: ids of {direct_path.name} and {think_path.name} differ "
            f"(only in direct: {only_direct[:5]}, only in think: {only_think[:5]})"
        )
    out = []
    for id_, (lineno, row) in think.items():
        d_lineno, d_row = direct[id_]
        criterion = _normalise(row["expect_en"])
        if _normalise(d_row["expect_en"]) != criterion:
            raise UReasonFormatError(
                f"id {id_!r}: expect_en differs between {direct_path}:{d_lineno} and {think_path}:{lineno}"
            )
        target = row.get("target_scene", d_row.get("target_scene"))
        if target is not None and not isinstance(target, dict):
            raise UReasonFormatError(f"{think_path}:{lineno}: 'target_scene' must be an object")
        out.append(
            UReasonInstance(
                id=id_,
                category=category,
                direct_prompt=d_row["prompt"],
                prompt=row["prompt"],
                expect_en=criterion,
                split=row.get("split", split),
                target_scene=target,
                source=f"{think_path}:{lineno}",
            )
        )
    return out


def load_ureason(
    root: str | Path,
    categories: Sequence[str] | None = None,
    split: str | None = None,
) -> list[UReasonInstance]:
    """All instances under ``root`` (a directory of ``direct_<cat>.jsonl`` / ``<cat>.jsonl`` pairs).

    ``categories``: default every category with a ``direct_`` file. ``split`` (``test`` or
    ``testmini``) selects ``<root>/<split>/`` if it exists, else rows whose ``"split"`` field
    matches.
    """
    root = Path(root)
    if not root.is_dir():
        raise UReasonFormatError(f"{root}: UReason data directory does not exist")
    if split is not None:
        if split not in SPLITS:
            raise UReasonFormatError(f"split must be one of {SPLITS}, got {split!r}")
        if (root / split).is_dir():
            root, split = root / split, None
    available = discover_categories(root)
    if not available:
        raise UReasonFormatError(f"{root}: no direct_<category>.jsonl files")
    categories = list(categories) if categories else available
    unknown = [c for c in categories if c not in available]
    if unknown:
        raise UReasonFormatError(f"{root}: no files for categories {unknown} (available: {available})")
    instances: list[UReasonInstance] = []
    for cat in categories:
        instances.extend(load_category(root, cat, split=split))
    if split is not None and not instances:
        raise UReasonFormatError(f"{root}: no rows with split '{split}' (and no {root / split} directory)")
    return instances


def load_shapes_ureason(world_root: str | Path, **kwargs) -> list[UReasonInstance]:
    """ShapesWorld's reasoning prompts, ``<world_root>/ureason/``; every row needs ``target_scene``."""
    root = Path(world_root) / "ureason"
    instances = load_ureason(root, **kwargs)
    for inst in instances:
        if inst.target_scene is None:
            raise UReasonFormatError(f"{inst.source}: ShapesWorld row has no 'target_scene'")
    return instances


def load_instances(data: str | Path, split: str | None = None,
                   categories: Sequence[str] | None = None) -> list[UReasonInstance]:
    """``data`` is a UReason directory (``direct_<cat>.jsonl`` pairs) or a ShapesWorld root."""
    data = Path(data)
    if not data.exists():
        raise UserError(f"UReason data {data} does not exist")
    if not any(data.glob("direct_*.jsonl")) and (data / "ureason").is_dir():
        return load_shapes_ureason(data, split=split, categories=categories)
    return load_ureason(data, split=split, categories=categories)


def world_root_of(data: str | Path) -> str | None:
    """The ShapesWorld root (holding ``world.json``) of a data path, if it is one."""
    data = Path(data)
    for root in (data, data.parent):
        if (root / "world.json").is_file():
            return str(root)
    return None


def subset(instances: Sequence[UReasonInstance], n: int | None) -> list[UReasonInstance]:
    """The first ``n`` instances taken round-robin over categories (so every category appears)."""
    if n is None or n >= len(instances):
        return list(instances)
    by_cat: dict[str, list[UReasonInstance]] = {}
    for inst in instances:
        by_cat.setdefault(inst.category, []).append(inst)
    out: list[UReasonInstance] = []
    depth = 0
    while len(out) < n:
        for rows in by_cat.values():
            if depth < len(rows) and len(out) < n:
                out.append(rows[depth])
        depth += 1
    return out
