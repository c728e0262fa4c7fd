"""Reading the study's material from ``unicon evaluate drift --out`` folders (read-only).

Per checkpoint folder ``OUT`` (see :mod:`unicon.evaluation.drift.runner` for the layout), the MCD chains
live in ``OUT/mcd`` (one process) or ``OUT/mcd/rank-<r>`` (sharded runs); a folder that is itself a
chain root (holds ``text-first/`` and ``image-first/``) is accepted too. Per seed ``id`` the study uses

* understanding: the input image ``image-first/gen-0/<id>.png`` (I0) and the first caption, row ``<id>.png``
  of ``image-first/gen-1.csv`` (T1);
* generation: the input prompt, row ``<id>.png`` of ``text-first/gen-0.csv`` (T0), and the first image
  ``text-first/gen-1/<id>.png`` (I1);

and from ``OUT/drift.json``: ``MCD_avg``, ``MGG`` and ``GenEval`` (the MGG accuracy of image
generation 1, i.e. single-pass GenEval).

A run's seeds are the rows of ``text-first/gen-0.csv``, the images of ``image-first/gen-0/`` and the
rows of ``image-first/gen-1.csv``; each of them must have all four pieces, every image must be a PNG
that decodes, and ``drift.json`` must exist: anything else is a :class:`UserError` naming the file
(and the seed). Every folder must hold the same seeds with the same inputs; with ``common_seeds``
(``unicon study create --common-seeds``) the study uses the seeds all folders hold instead.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from unicon.errors import UserError
from unicon.evaluation.drift.runner import ChainLayout


@dataclass
class ModelRun:
    """One checkpoint's drift output: its name, folder, metrics and first generations per seed."""

    name: str
    source: Path
    metrics: dict[str, float | None]
    prompts: dict[str, str] = field(default_factory=dict)         # T0
    inputs: dict[str, bytes] = field(default_factory=dict)        # I0 PNG bytes
    captions: dict[str, str] = field(default_factory=dict)        # T1
    images: dict[str, bytes] = field(default_factory=dict)        # I1 PNG bytes


def chain_roots(out: Path) -> list[Path]:
    """The chain roots of a drift output folder (module docstring)."""
    if (out / "text-first").is_dir() or (out / "image-first").is_dir():
        return [out]
    mcd = out / "mcd"
    if (mcd / "text-first").is_dir() or (mcd / "image-first").is_dir():
        return [mcd]
    ranks = sorted(p for p in mcd.glob("rank-*") if p.is_dir())
    if ranks:
        return ranks
    raise UserError(f"{out}: no drift chains found (expected {mcd}/text-first and image-first; "
                    "run unicon evaluate drift --out first)")


def read_metrics(out: Path) -> dict[str, float | None]:
    """``MCD_avg``, ``MGG`` and ``GenEval`` of ``OUT/drift.json`` (a metric None when the report lacks
    it); a missing ``drift.json`` is a :class:`UserError` naming it."""
    path = out / "drift.json"
    if not path.is_file():
        raise UserError(f"{path} not found: the drift run has no report (let unicon evaluate drift finish, "
                        "or merge its shards with --merge)")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    geneval = None
    per_gen = (report.get("mgg") or {}).get("per_generation") or {}
    first = per_gen.get("1", per_gen.get(1))
    if isinstance(first, dict):
        geneval = first.get("overall")
    return {"MCD_avg": report.get("MCD_avg"), "MGG": report.get("MGG"), "GenEval": geneval}


def _read_png(path: Path) -> bytes:
    """The bytes of a PNG image, checked to decode (the app serves them as ``image/png``)."""
    if not path.is_file():
        raise UserError(f"{path} not found: the drift run is incomplete (rerun unicon evaluate drift to resume)")
    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            im.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        detail = next(iter(str(e).splitlines()), "")
        raise UserError(f"{path}: not a PNG image ({type(e).__name__}: {detail})") from None
    if fmt != "PNG":
        raise UserError(f"{path}: not a PNG image ({fmt} data)")
    return data


def _row(rows: dict[str, str], path: Path, id_: str) -> str:
    if id_ not in rows:
        raise UserError(f"{path}: no row for seed {id_!r}: the drift run is incomplete (rerun unicon evaluate "
                        "drift to resume)")
    return rows[id_]


def read_run(name: str, out: Path) -> ModelRun:
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out}: not a folder (give drift output folders: unicon evaluate drift ... --out)")
    run = ModelRun(name, out, read_metrics(out))
    for root in chain_roots(out):
        layout = ChainLayout(root)
        for chain, g in (("text-first", 0), ("image-first", 1)):
            path = layout.captions_file(chain, g)
            if not path.is_file():
                raise UserError(f"{path} not found: the study needs both chain directions (--chains both)")
            try:
                rows = layout.captions(chain, g)
            except ValueError as e:
                raise UserError(str(e)) from None
            (run.prompts if chain == "text-first" else run.captions).update(rows)
        prompts, captions = layout.captions("text-first", 0), layout.captions("image-first", 1)
        inputs = sorted(p.stem for p in layout.image_dir("image-first", 0).glob("*.png"))
        for id_ in dict.fromkeys([*prompts, *inputs, *captions]):  # every seed, once, in file order
            _row(prompts, layout.captions_file("text-first", 0), id_)
            _row(captions, layout.captions_file("image-first", 1), id_)
            run.inputs[id_] = _read_png(layout.image_file("image-first", 0, id_))
            run.images[id_] = _read_png(layout.image_file("text-first", 1, id_))
    return run


def parse_run_arg(arg: str) -> tuple[str, Path]:
    """``NAME=PATH`` or ``PATH`` (the name is then the folder's name)."""
    if "=" in arg:
        name, path = arg.split("=", 1)
        if not name:
            raise UserError(f"{arg!r}: empty model name before '='")
        return name, Path(path)
    return Path(arg).resolve().name, Path(arg)


def _only_in(name: str, ids: list[str], limit: int = 5) -> str:
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return f"{len(ids)} only in {name} ({', '.join(map(repr, ids[:limit]))}{more})"


def read_runs(args: list[str], common_seeds: bool = False) -> tuple[list[ModelRun], list[str]]:
    """The runs and their seed ids (in the first run's order). Runs on other seed sets are a
    :class:`UserError` naming both runs and the seeds that differ, unless ``common_seeds``: then the
    ids are the seeds every run holds. Equal seeds with other prompts or input images are an error."""
    if len(args) < 2:
        raise UserError("a study compares at least two checkpoints: give two or more drift output folders")
    runs = []
    for arg in args:
        name, path = parse_run_arg(arg)
        if any(r.name == name for r in runs):
            raise UserError(f"two drift folders are both named {name!r}; name them: NAME=PATH")
        runs.append(read_run(name, path))
    first = runs[0]
    if not common_seeds:
        for r in runs[1:]:
            only_first = [i for i in first.prompts if i not in r.prompts]
            only_r = [i for i in r.prompts if i not in first.prompts]
            if only_first or only_r:
                parts = [_only_in(run.name, ids) for ids, run in ((only_first, first), (only_r, r)) if ids]
                raise UserError(f"{first.name} ({first.source}) and {r.name} ({r.source}) hold other seeds: "
                                f"{'; '.join(parts)}; a study compares drift runs on the same seeds (or pass "
                                "--common-seeds to use only the seeds every run holds)")
    ids = [i for i in first.prompts if all(i in r.prompts for r in runs)]
    if not ids:
        raise UserError("the drift folders share no seed (ids of text-first/gen-0.csv and image-first/gen-0/)")
    for r in runs[1:]:
        for i in ids:
            if r.prompts[i] != first.prompts[i]:
                raise UserError(f"{r.source}: seed {i!r} has another prompt than in {first.source}; "
                                "a study needs drift runs on the same seeds")
            if r.inputs[i] != first.inputs[i]:
                raise UserError(f"{r.source}: seed {i!r} has another input image than in {first.source}; "
                                "a study needs drift runs on the same seeds")
    return runs, ids
