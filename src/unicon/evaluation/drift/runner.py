"""Drift chains: model calls over the seeds, resumable on disk, scored into per-seed records.

**On disk** (:class:`ChainLayout`, the only place that knows it; compatible with the paper's
public layout: CSV columns ``filename,caption`` where ``filename`` is ``<id>.png``, the image the
caption belongs to)::

    ROOT/run.json                               ids, I2T prompt, batch size, seed, image settings, model
    ROOT/text-first/gen-0.csv                   T0 (the seeds' captions)
    ROOT/text-first/gen-1/<id>.png              I1
    ROOT/text-first/gen-2.csv                   T2 ...
    ROOT/image-first/gen-0/<id>.png             I0 (the seeds' images, as PNG)
    ROOT/image-first/gen-1.csv                  T1 ...
    ROOT/<chain>/gen-<g>.done.json              completion marker: count + sha256 of every item
    ROOT/<chain>/gen-<g>.partial.jsonl          journal of finished batches (only while g is running)

Every generation is computed for all chains of a root at once, in fixed batches of ``batch_size``
samples (``model.caption(images, prompt=i2t_prompt)`` / ``model.generate_image(prompts)``).

**Resume.** Every file is written to a temporary name and renamed (atomic), and a batch is
journaled only after its files are in place; a generation is complete when its marker exists.
On restart: complete generations are verified (every item's hash; CSV rows must name exactly
the chain ids in order) and never recomputed; an incomplete generation keeps its journaled
batches (image hashes re-checked) and redoes the rest; stray temporary files are removed. A
corrupt or missing item, or a CSV row mismatch, in a complete generation is reported (warning
with the path, and listed under ``"repairs"`` in ``drift.json``) and its batch regenerated (rows
whose content still matches the recorded hashes are only rewritten in order); if the regenerated
content differs from the recorded hashes (a sampling model), all later generations are
invalidated and recomputed. Batches have fixed membership and per-batch seeds, so an interrupted
run produces the same bytes as an uninterrupted one for any deterministic model.

**Ranks** (:mod:`unicon.evaluation.distributed`). Each rank runs the chains of its seeds under
``OUT/mcd`` and ``OUT/mgg`` (one process) or ``OUT/<set>/rank-<r>`` (several) and scores them into one
record per seed (cosines per embedder and mapping, GenEval verdicts per generation, the strip of the
first ``strips`` seeds); the metrics come from every rank's records, bit for bit those of one process
when the embedders and detector give the same numbers for an item in any batch (as the ShapesWorld
ones do).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from PIL import Image

from unicon.data.drift_seeds import DriftSeed
from unicon.embedders.base import Embedder
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.distributed import gather_objects, gather_records, rank_and_world, shard_indices, writes_outputs
from unicon import jsonsafe
from unicon.evaluation.drift import metrics, plots
from unicon.evaluation.drift.geneval import Detector, score_images
from unicon.evaluation.drift.metrics import CHAINS, MAPPINGS, PAPER_G, mapping_generations, modality
from unicon.loggers import environment_info
from unicon.models.base import ImageGenerationConfig, UnifiedModel
from unicon.progress import track

log = logging.getLogger(__name__)

#: largest side of the images a strip record carries between ranks (smaller images are kept as they are)
STRIP_IMAGE_SIDE = 256


# ---------------------------------------------------------------------------------------------------------
# Files: atomic writes, hashes, CSV
# ---------------------------------------------------------------------------------------------------------
def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def csv_bytes(rows: Sequence[tuple[str, str]]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["filename", "caption"])
    w.writerows(rows)
    return buf.getvalue().encode("utf-8")


def read_csv(path: Path) -> list[tuple[str, str]]:
    """Rows of a chain CSV; ``ValueError`` naming the file and line when malformed."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header != ["filename", "caption"]:
        raise ValueError(f"{path}:1: expected the header 'filename,caption', got {header}")
    rows = []
    for row in reader:
        if len(row) != 2:
            raise ValueError(f"{path}:{reader.line_num}: expected 2 columns, got {len(row)}")
        rows.append((row[0], row[1]))
    return rows


# ---------------------------------------------------------------------------------------------------------
# The on-disk layout
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChainLayout:
    """Where generation ``g`` of ``chain`` lives under ``root`` (module docstring), and reading it back."""

    root: Path

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    def chain_dir(self, chain: str) -> Path:
        return self.root / chain

    def captions_file(self, chain: str, g: int) -> Path:
        """The CSV of a text generation."""
        return self.root / chain / f"gen-{g}.csv"

    def image_dir(self, chain: str, g: int) -> Path:
        """The folder of an image generation."""
        return self.root / chain / f"gen-{g}"

    def image_file(self, chain: str, g: int, id_: str) -> Path:
        return self.image_dir(chain, g) / f"{id_}.png"

    def marker(self, chain: str, g: int) -> Path:
        return self.root / chain / f"gen-{g}.done.json"

    def journal(self, chain: str, g: int) -> Path:
        return self.root / chain / f"gen-{g}.partial.jsonl"

    @staticmethod
    def row_name(id_: str) -> str:
        """The ``filename`` column of a chain CSV row: the image the caption belongs to."""
        return f"{id_}.png"

    def captions(self, chain: str, g: int) -> dict[str, str]:
        """``{id: caption}`` of a text generation; ``ValueError`` naming the file when malformed."""
        return {name.removesuffix(".png"): caption for name, caption in read_csv(self.captions_file(chain, g))}

    def image(self, chain: str, g: int, id_: str) -> Image.Image:
        path = self.image_file(chain, g, id_)
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (OSError, SyntaxError) as e:
            raise ValueError(f"{path}: cannot read image ({e})") from None

    def load(self, chain: str, g: int, ids: Sequence[str]) -> list:
        """Captions or images of generation ``g`` of ``chain`` in ``ids`` order."""
        if modality(chain, g) == "image":
            return [self.image(chain, g, i) for i in ids]
        path = self.captions_file(chain, g)
        if not path.is_file():
            raise UserError(f"{path} not found: run the chains first (unicon evaluate drift ...)")
        captions = self.captions(chain, g)
        missing = [i for i in ids if i not in captions]
        if missing:
            raise ValueError(f"{path}: no row for {missing[:3]}")
        return [captions[i] for i in ids]


def chains_for(seeds: Sequence[DriftSeed], requested: Sequence[str]) -> tuple[str, ...]:
    """The chain directions ``seeds`` can start: prompt-only seeds (GenEval) are text-first only."""
    if any(s.image is None for s in seeds):
        return ("text-first",)
    return tuple(requested)


# ---------------------------------------------------------------------------------------------------------
# The chain runner
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ChainRun:
    """What :func:`run_chains` did: where, which generations were computed, repairs, timing."""

    layout: ChainLayout
    ids: list[str]
    generations: int
    chains: tuple[str, ...]
    computed: dict[str, list[int]] = field(default_factory=dict)  # chain -> generations (re)computed
    repairs: list[str] = field(default_factory=list)
    model_seconds: float = 0.0
    model_steps: int = 0  # sample-generations produced by the model (one caption or one image each)


class ChainRunner:
    """Runs (and resumes) drift chains for one model and one seed set into ``out``."""

    def __init__(
        self, model: UnifiedModel, seeds: Sequence[DriftSeed], out: str | Path, *, generations: int,
        batch_size: int, chains: Sequence[str] = CHAINS, i2t_prompt: str | None = None,
        image_config: ImageGenerationConfig | None = None, seed: int = 0, model_id: dict | None = None,
    ):
        if generations < 1:
            raise UserError(f"generations must be >= 1, got {generations}")
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        unknown = sorted(set(chains) - set(CHAINS))
        if unknown or not chains:
            raise UserError(f"unknown chain direction(s) {unknown}; use {list(CHAINS)}")
        if not seeds:
            raise UserError("no seeds to start chains from")
        for s in seeds:
            if "text-first" in chains and not s.caption:
                raise UserError(f"seed {s.id!r} has no caption (needed by text-first chains)")
            if "image-first" in chains and s.image is None:
                raise UserError(f"seed {s.id!r} has no image (needed by image-first chains)")
        self.model, self.seeds, self.layout = model, list(seeds), ChainLayout(Path(out))
        self.ids = [s.id for s in self.seeds]
        self.generations, self.chains, self.batch_size = generations, tuple(chains), batch_size
        self.i2t_prompt, self.image_config, self.seed = i2t_prompt, image_config, seed
        self.model_id = model_id  # {"checkpoint", "fingerprint"}: a resume under other weights is refused
        self.batches = [self.ids[i : i + batch_size] for i in range(0, len(self.ids), batch_size)]
        self.result = ChainRun(self.layout, self.ids, generations, self.chains)

    # -- reporting ---------------------------------------------------------------------------------------
    def _repair(self, msg: str) -> None:
        log.warning("drift resume: %s", msg)
        self.result.repairs.append(msg)

    # -- run.json --------------------------------------------------------------------------------------
    def _check_run_file(self) -> None:
        """``run.json`` pins what stored generations depend on; resuming with other settings is refused."""
        info = {
            "ids": self.ids, "i2t_prompt": self.i2t_prompt, "batch_size": self.batch_size, "seed": self.seed,
            "image_config": asdict(self.image_config) if self.image_config else None,
        }
        if self.model_id:
            info["model_fingerprint"] = self.model_id["fingerprint"]
            info["checkpoint"] = self.model_id["checkpoint"]  # recorded; the weights decide
        path = self.layout.run_file
        if path.is_file():
            try:
                old = json.loads(path.read_text())
            except json.JSONDecodeError:
                old = None
                self._repair(f"{path} is corrupt; rewritten")
            for key, value in (old or {}).items():
                if key == "model_fingerprint" and key in info and value != info[key]:
                    raise UserError(
                        f"{path}: this directory holds chains of another model ({old.get('checkpoint')}, weights "
                        f"{value}) than {info['checkpoint']} (weights {info[key]}); use another --out"
                    )
                if key in info and key != "checkpoint" and value != info[key]:
                    raise UserError(
                        f"{path}: this directory holds chains with a different {key} "
                        f"({str(value)[:80]} != {str(info[key])[:80]}); use another --out or the same "
                        "settings"
                    )
        atomic_write(path, json.dumps(info, indent=1, allow_nan=False).encode())

    # -- verification of complete generations -------------------------------------------------------
    def _read_marker(self, chain: str, g: int) -> dict | None:
        path = self.layout.marker(chain, g)
        if not path.is_file():
            return None
        try:
            marker = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            marker = None
        if not isinstance(marker, dict) or not isinstance(marker.get("items"), dict):
            self._repair(f"{path}: unreadable completion marker; generation {g} of {chain} is redone")
            path.unlink()
            return None
        if sorted(marker["items"]) != sorted(self.ids):
            raise UserError(f"{path}: marker lists other chain ids than this run (use another --out)")
        return marker

    def _bad_items(self, chain: str, g: int, marker: dict) -> set[str]:
        """Ids whose on-disk content does not match the marker (reported with the path)."""
        bad = set()
        if modality(chain, g) == "text":
            path = self.layout.captions_file(chain, g)
            if not path.is_file():
                self._repair(f"{path} is missing; regenerating")
                return set(self.ids)
            try:
                rows = read_csv(path)
            except ValueError as e:
                self._repair(f"{e}; regenerating {path}")
                return set(self.ids)
            names = [r[0] for r in rows]
            expected = [self.layout.row_name(i) for i in self.ids]
            if names != expected:
                self._repair(f"{path}: rows do not match the chain ids ({len(rows)} rows for "
                             f"{len(self.ids)} chains); regenerating the mismatched rows")
            got = dict(rows)
            for i in self.ids:
                caption = got.get(self.layout.row_name(i))
                if caption is None or sha256(caption.encode()) != marker["items"][i]:
                    bad.add(i)
            if bad and names == expected:
                self._repair(f"{path}: caption of {sorted(bad)[:5]} does not match its recorded hash; "
                             "regenerating")
            if not bad and names != expected:  # right content, wrong rows/order
                atomic_write(path, csv_bytes([(self.layout.row_name(i), got[self.layout.row_name(i)])
                                              for i in self.ids]))
            return bad
        for i in self.ids:
            path = self.layout.image_file(chain, g, i)
            if not path.is_file():
                self._repair(f"{path} is missing; regenerating")
                bad.add(i)
                continue
            if sha256(path.read_bytes()) != marker["items"][i]:
                self._repair(f"{path} is corrupt (hash mismatch); regenerating")
                bad.add(i)
        return bad

    # -- producing one batch ---------------------------------------------------------------------------
    def _batch_seed(self, chain: str, g: int, b: int) -> int:
        h = hashlib.sha256(f"{self.seed}/{chain}/{g}/{b}".encode()).digest()
        return int.from_bytes(h[:4], "little")

    def _produce(self, chain: str, g: int, b: int, ids: list[str], prev_texts: dict[str, str] | None) -> dict:
        """One batch through the model: ``{id: caption}``, or write the images and return ``{id: sha256}``."""
        out_mod = modality(chain, g)
        t0 = time.perf_counter()
        if g == 0:
            seeds = {s.id: s for s in self.seeds}
            if out_mod == "text":
                return {i: seeds[i].caption for i in ids}
            result = {}
            for i in ids:
                try:
                    with Image.open(seeds[i].image) as im:
                        data = png_bytes(im)
                except (OSError, SyntaxError) as e:
                    raise UserError(f"seed image {seeds[i].image} cannot be read ({e})") from None
                atomic_write(self.layout.image_file(chain, 0, i), data)
                result[i] = sha256(data)
            return result
        if out_mod == "text":
            images = [self.layout.image(chain, g - 1, i) for i in ids]
            kwargs = {} if self.i2t_prompt is None else {"prompt": self.i2t_prompt}
            captions = self.model.caption(images, **kwargs)
            if len(captions) != len(ids):
                raise RuntimeError(f"model.caption returned {len(captions)} captions for {len(ids)} images")
            result = {i: str(c) for i, c in zip(ids, captions)}
        else:
            prompts = [prev_texts[i] for i in ids]
            cfg = dataclasses.replace(self.image_config or self.model.image_generation_config)
            if cfg.seed is not None or cfg.do_sample:  # one fixed seed per (chain, generation, batch)
                cfg.seed = (cfg.seed or 0) + self._batch_seed(chain, g, b)
            images = self.model.generate_image(prompts, config=cfg)
            if len(images) != len(ids):
                raise RuntimeError(f"model.generate_image gave {len(images)} images for {len(ids)} prompts")
            result = {}
            for i, im in zip(ids, images):
                data = png_bytes(im)
                atomic_write(self.layout.image_file(chain, g, i), data)
                result[i] = sha256(data)
        self.result.model_seconds += time.perf_counter() - t0
        self.result.model_steps += len(ids)
        return result

    # -- one generation -------------------------------------------------------------------------------
    def _read_journal(self, chain: str, g: int) -> dict[int, dict]:
        path = self.layout.journal(chain, g)
        done: dict[int, dict] = {}
        is_image = modality(chain, g) == "image"
        if not path.is_file():
            return done
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                entry = json.loads(line)
                b = int(entry["batch"])
                payload = entry["items" if is_image else "captions"]
                valid = entry["ids"] == self.batches[b] and set(payload) == set(entry["ids"])
            except (json.JSONDecodeError, KeyError, ValueError, IndexError, TypeError):
                valid = False
            if not valid:
                self._repair(f"{path}:{lineno}: incomplete journal line (interrupted write); batch redone")
                continue
            if is_image:
                ok = True
                for i, h in entry["items"].items():
                    p = self.layout.image_file(chain, g, i)
                    if not p.is_file() or sha256(p.read_bytes()) != h:
                        self._repair(f"{p} is missing or half-written; regenerating its batch")
                        ok = False
                if not ok:
                    continue
            done[b] = entry["items"] if is_image else entry["captions"]
        return done

    def _run_generation(
        self, chain: str, g: int, redo_ids: set[str] | None = None, marker: dict | None = None
    ) -> bool:
        """Compute generation ``g`` (all batches, or the batches holding ``redo_ids``).

        Returns True when the stored content changed relative to ``marker`` (later generations stale).
        """
        is_text = modality(chain, g) == "text"
        prev_texts = self.layout.captions(chain, g - 1) if g > 0 and not is_text else None
        jpath = self.layout.journal(chain, g)
        if redo_ids is None:
            done = self._read_journal(chain, g)
            todo = [b for b in range(len(self.batches)) if b not in done]
            if done:
                log.info("%s gen %d: resuming, %d/%d batches done", chain, g, len(done), len(self.batches))
        else:  # repair of a complete generation: keep everything else from the marker / CSV
            todo = sorted({b for b, ids in enumerate(self.batches) if redo_ids & set(ids)})
            done = {}
            if is_text:
                good = {}
                if self.layout.captions_file(chain, g).is_file():
                    try:
                        good = self.layout.captions(chain, g)
                    except ValueError:
                        good = {}
                done = {b: {i: good[i] for i in ids} for b, ids in enumerate(self.batches) if b not in todo}
        results: dict[str, str] = {}
        for items in done.values():
            results.update(items)
        for b in track(todo, f"drift: {chain} generation {g}", unit="batches"):
            preemption.check()  # between batches: the journal holds every finished one
            items = self._produce(chain, g, b, self.batches[b], prev_texts)
            results.update(items)
            entry = {"batch": b, "ids": self.batches[b]}
            entry["captions" if is_text else "items"] = items
            jpath.parent.mkdir(parents=True, exist_ok=True)
            with open(jpath, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if is_text:
            atomic_write(self.layout.captions_file(chain, g),
                         csv_bytes([(self.layout.row_name(i), results[i]) for i in self.ids]))
            hashes = {i: sha256(results[i].encode()) for i in self.ids}
        else:
            hashes = {i: (results[i] if i in results else marker["items"][i]) for i in self.ids}
        changed = marker is not None and any(hashes[i] != marker["items"][i] for i in self.ids)
        new_marker = {"generation": g, "chain": chain, "modality": modality(chain, g), "count": len(self.ids),
                      "items": hashes}
        atomic_write(self.layout.marker(chain, g), json.dumps(new_marker, indent=0, allow_nan=False).encode())
        if jpath.exists():
            jpath.unlink()
        self.result.computed.setdefault(chain, []).append(g)
        return changed

    def _clean_temporaries(self, chain: str) -> None:
        for p in sorted(self.layout.chain_dir(chain).rglob(".*.tmp-*")):
            self._repair(f"{p}: leftover of an interrupted write; removed")
            p.unlink()

    def _invalidate_from(self, chain: str, g: int) -> None:
        for k in range(g, self.generations + 1):
            for p in (self.layout.marker(chain, k), self.layout.journal(chain, k)):
                if p.exists():
                    p.unlink()

    def run(self) -> ChainRun:
        self.layout.root.mkdir(parents=True, exist_ok=True)
        self._check_run_file()
        for chain in self.chains:
            self.layout.chain_dir(chain).mkdir(exist_ok=True)
            self._clean_temporaries(chain)
            for g in track(range(self.generations + 1), f"drift: {chain} chains", unit="generations"):
                marker = self._read_marker(chain, g)
                if marker is None:
                    self._run_generation(chain, g)
                    self._invalidate_from(chain, g + 1)
                    continue
                bad = self._bad_items(chain, g, marker)
                if bad:
                    if self._run_generation(chain, g, redo_ids=bad, marker=marker):
                        self._repair(f"{chain} gen {g}: regenerated content differs from the recorded one; "
                                     f"generations {g + 1}.. are recomputed")
                        self._invalidate_from(chain, g + 1)
        return self.result


def run_chains(model: UnifiedModel, seeds: Sequence[DriftSeed], out: str | Path, **kwargs) -> ChainRun:
    """Run or resume drift chains; see :class:`ChainRunner` for the options."""
    return ChainRunner(model, seeds, out, **kwargs).run()


# ---------------------------------------------------------------------------------------------------------
# Scoring chains into per-seed records
# ---------------------------------------------------------------------------------------------------------
def chain_similarities(layout: ChainLayout, ids: Sequence[str], embedders: Mapping[str, Embedder],
                       generations: int, chains: Sequence[str]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """``{id: {embedder: {mapping: [cos(e(inp), e(M^(g))) for g in G_delta]}}}``, the input of
    :func:`metrics.mcd`: each embedder, each mapping it supports on the chains run."""
    per_id: dict[str, dict[str, dict[str, list[float]]]] = {i: {} for i in ids}
    for name, emb in track(embedders.items(), "drift: similarities", len(embedders), unit="embedders"):
        for i in ids:
            per_id[i][name] = {}
        for mapping, (chain, _, src, tgt) in MAPPINGS.items():
            gens = mapping_generations(mapping, generations)
            if chain not in chains or not emb.supports(src, tgt) or not gens:
                continue
            inp = emb.embed(src, layout.load(chain, 0, ids))
            columns = []
            for g in gens:
                preemption.check()
                columns.append((inp * emb.embed(tgt, layout.load(chain, g, ids))).sum(-1).tolist())  # unit vectors
            for k, i in enumerate(ids):
                per_id[i][name][mapping] = [column[k] for column in columns]
    return per_id


def geneval_verdicts(layout: ChainLayout, seeds: Sequence[DriftSeed], generations: int,
                     detector: Detector) -> dict[str, dict[int, bool]]:
    """``{id: {g: correct}}``: GenEval of every image generation of the text-first chains, the
    input of :func:`metrics.mgg` (seeds carry ``geneval``)."""
    ids = [s.id for s in seeds]
    prompts = [s.geneval for s in seeds]
    verdicts: dict[str, dict[int, bool]] = {i: {} for i in ids}
    for g in track(range(1, generations + 1, 2), "drift: GenEval judging", unit="generations"):
        preemption.check()
        _, results = score_images(prompts, layout.load("text-first", g, ids), detector)
        for i, r in zip(ids, results):
            verdicts[i][g] = r.correct
    return verdicts


def chain_trail(layout: ChainLayout, chain: str, id_: str, generations: int) -> list[str | Image.Image]:
    """Generations ``0..generations`` of one chain (captions, and images at most
    :data:`STRIP_IMAGE_SIDE` px a side): what the strip plots show."""
    items = []
    for g in range(generations + 1):
        item = layout.load(chain, g, [id_])[0]
        if isinstance(item, Image.Image):
            item.thumbnail((STRIP_IMAGE_SIDE, STRIP_IMAGE_SIDE))
        items.append(item)
    return items


def rank_root(root: Path) -> Path:
    """Where this rank's chains of a seed set go: ``root`` itself in one process, else
    ``root/rank-<r>`` (every rank resumes its own chains; nothing is shared between ranks)."""
    rank, world = rank_and_world()
    return root if world == 1 else root / f"rank-{rank}"


# ---------------------------------------------------------------------------------------------------------
# The whole evaluation
# ---------------------------------------------------------------------------------------------------------
def evaluate_drift(
    model: UnifiedModel, out: str | Path, *, generations: int, batch_size: int, strips: int,
    seeds: Sequence[DriftSeed] | None = None, geneval_seeds: Sequence[DriftSeed] | None = None,
    i2t_prompt: str | None = None, embedders: Mapping[str, Embedder] | None = None,
    detector: Detector | None = None, chains: Sequence[str] = CHAINS,
    image_config: ImageGenerationConfig | None = None, seed: int = 0, model_id: dict | None = None,
    geneval_file: str | None = None,
) -> dict[str, Any]:
    """Run/resume the chains (this rank's shard), compute MCD (``seeds`` and ``embedders``) and MGG
    (``geneval_seeds`` and ``detector``) from the records of all ranks; rank 0 writes
    ``OUT/drift.json``, the plots (:mod:`.plots`) and ``OUT/strips/`` (the strip table's images).
    Returns the ``drift.json`` content (on every rank).

    ``model_id`` (``{"checkpoint", "fingerprint"}``) is recorded in ``drift.json`` and in each
    chain folder's ``run.json``, and a resume under other weights is refused; ``geneval_file``
    names the GenEval metadata file the MGG prompts come from. ``drift.json`` also records the
    image-generation settings and the environment (git commit, package versions)."""
    out = Path(out)
    if geneval_seeds:
        if detector is None:
            raise UserError("MGG needs a detector (shapes or owlv2:<path>)")
        missing = [s.id for s in geneval_seeds if s.geneval is None]
        if missing:
            raise UserError(f"MGG needs GenEval seeds; {missing[:3]} carry no GenEval metadata")
    report: dict[str, Any] = {
        "generations": generations, "i2t_prompt": i2t_prompt, "repairs": [],
        "image_generation": asdict(image_config or model.image_generation_config),
        # G: MCD and MGG average over generations 1..G, so only runs with the same G compare
        "G": {"value": generations, "paper": PAPER_G, "comparable_with_paper": generations == PAPER_G},
        "embedders": {name: emb.describe() for name, emb in (embedders or {}).items()},
    }
    if geneval_seeds:
        report["detector"] = detector.describe()
    if model_id:
        report.update(checkpoint=model_id["checkpoint"], model_fingerprint=model_id["fingerprint"])
    if geneval_seeds:
        report["geneval_file"] = geneval_file
    common = dict(generations=generations, batch_size=batch_size, i2t_prompt=i2t_prompt,
                  image_config=image_config, seed=seed, model_id=model_id)
    repairs: list[str] = []
    trails: list[tuple[str, str, list]] = []
    if seeds:
        index = shard_indices(len(seeds))
        mine = [seeds[k] for k in index]
        run = run_chains(model, mine, rank_root(out / "mcd"), chains=chains, **common) if mine else None  # merge: none
        repairs += run.repairs if run else []
        sims = chain_similarities(run.layout, run.ids, embedders or {}, generations, chains) if run else {}
        records = gather_records({
            k: {"similarity": sims[s.id],
                "trail": {c: chain_trail(run.layout, c, s.id, generations) for c in chains} if k < strips else None}
            for k, s in zip(index, mine)
        })
        report["num_chains"] = len(records)
        if embedders:
            mcd = metrics.mcd([r["similarity"] for r in records.values()], generations)
            report["mcd"] = mcd
            # SDR_abc_mean: the reference code's printed "SDR"; the reasons only where a value is None
            report.update({key: mcd[key] for key in ("MCD_avg", "MCD", "SDR", "SDR_avg", "SDR_abc_mean",
                                                     "MCD_avg_reason", "SDR_avg_reason") if key in mcd})
        trails = [(c, seeds[k].id, r["trail"][c]) for c in chains for k, r in records.items() if r["trail"]]
    if geneval_seeds:
        index = shard_indices(len(geneval_seeds))
        mine = [geneval_seeds[k] for k in index]
        run = run_chains(model, mine, rank_root(out / "mgg"), chains=("text-first",), **common) if mine else None
        repairs += run.repairs if run else []
        verdicts = geneval_verdicts(run.layout, mine, generations, detector) if run else {}
        records = gather_records({k: verdicts[s.id] for k, s in zip(index, mine)})
        mgg = metrics.mgg([geneval_seeds[k].geneval.tag for k in records], list(records.values()))
        report["mgg"] = mgg
        report["MGG"], report["MGG_micro"] = mgg["MGG"], mgg["MGG_micro"]
    report["repairs"] = [msg for part in gather_objects(repairs) for msg in part]
    if trails:
        report["strips"] = plots.strip_entries(trails)
    report["environment"] = environment_info()
    if writes_outputs():  # rank 0 / one process / a merge; never a --shard job
        out.mkdir(parents=True, exist_ok=True)
        if "mcd" in report:
            plots.plot_curves(report["mcd"], out / "drift_curves.png")
        if "mgg" in report:
            plots.plot_mgg_heatmap(report["mgg"], out / "mgg_heatmap.png")
        if trails:
            plots.plot_strips(trails, out / "strips.png")
            plots.save_strip_images(trails, out)
        atomic_write(out / "drift.json", jsonsafe.dumps(report, indent=1, default=float).encode())
    return report
