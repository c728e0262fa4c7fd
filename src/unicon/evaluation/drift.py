"""Semantic drift chains (the "Telephone Game"): resumable I2T <-> T2I chains, MCD and MGG.

Chains (paper section 3). With ``G`` generations and a unified model ``UM``:

* **text-first**:  ``T0 -T2I-> I1 -I2T-> T2 -T2I-> I3 ...``
* **image-first**: ``I0 -I2T-> T1 -T2I-> I2 -I2T-> T3 ...``

Every generation is computed for all chains at once, in fixed batches of ``batch_size`` samples
(``model.caption(images, prompt=i2t_prompt)`` / ``model.generate_image(prompts)``).

On disk (compatible with the paper's public layout; CSV columns ``filename,caption`` where
``filename`` is ``<id>.png``, the image the caption belongs to)::

    OUT/run.json                               ids, I2T prompt, batch size, seed (checked on resume)
    OUT/text-first/gen-0.csv                   T0 (the seeds' captions)
    OUT/text-first/gen-1/<id>.png              I1
    OUT/text-first/gen-2.csv                   T2 ...
    OUT/image-first/gen-0/<id>.png             I0 (the seeds' images, as PNG)
    OUT/image-first/gen-1.csv                  T1 ...
    OUT/<chain>/gen-<g>.done.json              completion marker: count + sha256 of every item
    OUT/<chain>/gen-<g>.partial.jsonl          journal of finished batches (only while g is running)

**Resume.** Every file is written to a temporary name and renamed (atomic), and a batch is
journaled only after its files are in place; a generation is complete when its marker exists.
On restart: complete generations are verified (every item's hash; CSV rows must name exactly
the chain ids in order) and never recomputed; an incomplete generation keeps its journaled
batches (image hashes re-checked) and redoes the rest; stray temporary files are removed. A
corrupt or missing item, or a CSV row mismatch, in a complete generation is reported (warning
with the path, and listed under ``"repairs"`` in ``drift.json``) and its batch regenerated (rows
whose content still matches the recorded hashes are only rewritten in order); if
the regenerated content differs from the recorded hashes (a sampling model), all later
generations are invalidated and recomputed. Batches have fixed membership and per-batch seeds,
so an interrupted run produces the same bytes as an uninterrupted one for any deterministic model.

**MCD** (Eq. 1-2). For a distance mapping ``delta`` (``t2t``, ``t2i``: text-first, even / odd
generations; ``i2i``, ``i2t``: image-first, even / odd generations)::

    S_delta(g) = 1/|D| sum_d cos(e(inp_d), e(M_d^(g)))        (inp_d = gen-0 item of chain d)
    MCD_delta  = mean of S_delta(g) over the generations g in 1..G where delta is defined
    MCD_avg    = mean over the four mappings (over those computed, e.g. two for text-only seeds)

Eq. 2 writes ``1/G sum_{g=1..G}``; each mapping only exists at every other generation, so the
mean runs over those (``ceil(G/2)`` odd or ``floor(G/2)`` even generations). Each embedder that
supports a mapping gets its own S/MCD (``by_embedder``); the headline value of a mapping uses the
first available of :data:`PREFERRED` (sentence embedder for t2t, DINO for i2i, CLIP across modalities).
The semantic drift rate is ``b`` of the fit ``S_delta(g) ~ a * exp(-b g) + c`` (scipy ``curve_fit``,
``b >= 0``; ``{"error": reason}`` instead when there are fewer than 3 points or the fit fails).

**MGG**: GenEval on the images of every image-bearing generation (1, 3, 5, ...) of text-first
chains started from GenEval prompts; per generation the overall score is the mean of the task
accuracies (GenEval's summary; the paper's public script micro-averages over images, also
reported as ``MGG_micro``); ``MGG`` is the mean over those generations.

:func:`evaluate_drift` writes ``OUT/mcd/`` (chains from the MCD seeds), ``OUT/mgg/`` (text-first
chains from GenEval prompts), ``OUT/drift.json`` (S, MCD, fits, per-task per-generation GenEval,
repairs) and the plots ``drift_curves.png`` (Fig. 6), ``mgg_heatmap.png`` (Fig. 11) and
``strips.png`` (images and captions along a few chains). Entry points: :class:`DriftCallback`,
:func:`cli` (``unicon evaluate drift``) and :func:`bench_cli` (``unicon bench chains``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import logging
import math
import os
import shutil
import tempfile
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from unicon.data.drift_seeds import DriftSeed
from unicon.embedders.base import Embedder
from unicon.config import DriftEvalConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.cli_common import add_common_args, check_common_args, load_model_for
from unicon.evaluation.callbacks import EvalCallback, log_eval_config, log_figures, log_metrics, log_table, log_wandb
from unicon.models.base import ImageGenerationConfig, UnifiedModel

log = logging.getLogger(__name__)

CHAINS = ("text-first", "image-first")
#: mapping -> (chain, parity of its generations, source modality, target modality)
MAPPINGS = {
    "t2t": ("text-first", 0, "text", "text"),
    "t2i": ("text-first", 1, "text", "image"),
    "i2i": ("image-first", 0, "image", "image"),
    "i2t": ("image-first", 1, "image", "text"),
}
PREFERRED = {"t2t": ("text", "clip", "scene"), "t2i": ("clip", "scene"), "i2i": ("dino", "clip", "scene"),
             "i2t": ("clip", "scene")}
DEFAULT_I2T_PROMPT = None  # None: the backend's own captioning prompt


def modality(chain: str, g: int) -> str:
    """``"text"`` or ``"image"``: what generation ``g`` of ``chain`` holds."""
    first = "text" if chain == "text-first" else "image"
    return first if g % 2 == 0 else ("image" if first == "text" else "text")


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
# The chain runner
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ChainRun:
    """What :func:`run_chains` did: where, which generations were computed, repairs, timing."""

    out: Path
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
        self, model: UnifiedModel, seeds: Sequence[DriftSeed], out: str | Path, generations: int = 20,
        chains: Sequence[str] = CHAINS, batch_size: int = 8, i2t_prompt: str | None = DEFAULT_I2T_PROMPT,
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
        self.model, self.seeds, self.out = model, list(seeds), Path(out)
        self.ids = [s.id for s in self.seeds]
        self.generations, self.chains, self.batch_size = generations, tuple(chains), batch_size
        self.i2t_prompt, self.image_config, self.seed = i2t_prompt, image_config, seed
        self.model_id = model_id  # {"checkpoint", "fingerprint"}: a resume under other weights is refused
        self.batches = [self.ids[i : i + batch_size] for i in range(0, len(self.ids), batch_size)]
        self.result = ChainRun(self.out, self.ids, generations, self.chains)

    # -- paths ------------------------------------------------------------------------------------------
    def item_path(self, chain: str, g: int, id_: str | None = None) -> Path:
        base = self.out / chain
        if modality(chain, g) == "text":
            return base / f"gen-{g}.csv"
        return base / f"gen-{g}" / f"{id_}.png" if id_ is not None else base / f"gen-{g}"

    def marker(self, chain: str, g: int) -> Path:
        return self.out / chain / f"gen-{g}.done.json"

    def journal(self, chain: str, g: int) -> Path:
        return self.out / chain / f"gen-{g}.partial.jsonl"

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
        path = self.out / "run.json"
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
        atomic_write(path, json.dumps(info, indent=1).encode())

    # -- verification of complete generations -------------------------------------------------------
    def _read_marker(self, chain: str, g: int) -> dict | None:
        path = self.marker(chain, g)
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
            path = self.item_path(chain, g)
            if not path.is_file():
                self._repair(f"{path} is missing; regenerating")
                return set(self.ids)
            try:
                rows = read_csv(path)
            except ValueError as e:
                self._repair(f"{e}; regenerating {path}")
                return set(self.ids)
            names = [r[0] for r in rows]
            if names != [f"{i}.png" for i in self.ids]:
                self._repair(f"{path}: rows do not match the chain ids ({len(rows)} rows for "
                             f"{len(self.ids)} chains); regenerating the mismatched rows")
            got = dict(rows)
            for i in self.ids:
                caption = got.get(f"{i}.png")
                if caption is None or sha256(caption.encode()) != marker["items"][i]:
                    bad.add(i)
            if bad and names == [f"{i}.png" for i in self.ids]:
                self._repair(f"{path}: caption of {sorted(bad)[:5]} does not match its recorded hash; "
                             "regenerating")
            if not bad and names != [f"{i}.png" for i in self.ids]:  # right content, wrong rows/order
                atomic_write(path, csv_bytes([(f"{i}.png", got[f"{i}.png"]) for i in self.ids]))
            return bad
        for i in self.ids:
            path = self.item_path(chain, g, i)
            if not path.is_file():
                self._repair(f"{path} is missing; regenerating")
                bad.add(i)
                continue
            data = path.read_bytes()
            if sha256(data) != marker["items"][i]:
                self._repair(f"{path} is corrupt (hash mismatch); regenerating")
                bad.add(i)
                continue
        return bad

    # -- reading generations -------------------------------------------------------------------------
    def texts(self, chain: str, g: int) -> dict[str, str]:
        return {name[: -len(".png")]: cap for name, cap in read_csv(self.item_path(chain, g))}

    def image(self, chain: str, g: int, id_: str) -> Image.Image:
        path = self.item_path(chain, g, id_)
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (OSError, SyntaxError) as e:
            raise ValueError(f"{path}: cannot read image ({e})") from None

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
                result = {i: seeds[i].caption for i in ids}
            else:
                result = {}
                for i in ids:
                    try:
                        with Image.open(seeds[i].image) as im:
                            data = png_bytes(im)
                    except (OSError, SyntaxError) as e:
                        raise UserError(f"seed image {seeds[i].image} cannot be read ({e})") from None
                    atomic_write(self.item_path(chain, 0, i), data)
                    result[i] = sha256(data)
            return result
        if out_mod == "text":
            images = [self.image(chain, g - 1, i) for i in ids]
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
                atomic_write(self.item_path(chain, g, i), data)
                result[i] = sha256(data)
        self.result.model_seconds += time.perf_counter() - t0
        self.result.model_steps += len(ids)
        return result

    # -- one generation -------------------------------------------------------------------------------
    def _read_journal(self, chain: str, g: int) -> dict[int, dict]:
        path = self.journal(chain, g)
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
                    p = self.item_path(chain, g, i)
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
        prev_texts = self.texts(chain, g - 1) if g > 0 and not is_text else None
        jpath = self.journal(chain, g)
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
                if self.item_path(chain, g).is_file():
                    try:
                        good = self.texts(chain, g)
                    except ValueError:
                        good = {}
                done = {b: {i: good[i] for i in ids} for b, ids in enumerate(self.batches) if b not in todo}
        results: dict[str, str] = {}
        for b, items in done.items():
            results.update(items)
        for b in todo:
            preemption.check()  # between batches: the journal holds every finished one
            items = self._produce(chain, g, b, self.batches[b], prev_texts)
            results.update(items)
            entry = {"batch": b, "ids": self.batches[b]}
            entry["captions" if is_text else "items"] = items
            jpath.parent.mkdir(parents=True, exist_ok=True)
            with open(jpath, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if is_text:
            atomic_write(self.item_path(chain, g), csv_bytes([(f"{i}.png", results[i]) for i in self.ids]))
            hashes = {i: sha256(results[i].encode()) for i in self.ids}
        else:
            hashes = {i: (results[i] if i in results else marker["items"][i]) for i in self.ids}
        changed = marker is not None and any(hashes[i] != marker["items"][i] for i in self.ids)
        new_marker = {"generation": g, "chain": chain, "modality": modality(chain, g), "count": len(self.ids),
                      "items": hashes}
        atomic_write(self.marker(chain, g), json.dumps(new_marker, indent=0).encode())
        if jpath.exists():
            jpath.unlink()
        self.result.computed.setdefault(chain, []).append(g)
        return changed

    def _clean_temporaries(self, chain: str) -> None:
        for p in sorted((self.out / chain).rglob(".*.tmp-*")):
            self._repair(f"{p}: leftover of an interrupted write; removed")
            p.unlink()

    def _invalidate_from(self, chain: str, g: int) -> None:
        for k in range(g, self.generations + 1):
            for p in (self.marker(chain, k), self.journal(chain, k)):
                if p.exists():
                    p.unlink()

    def run(self) -> ChainRun:
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_run_file()
        for chain in self.chains:
            (self.out / chain).mkdir(exist_ok=True)
            self._clean_temporaries(chain)
            for g in range(self.generations + 1):
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
# MCD
# ---------------------------------------------------------------------------------------------------------
def load_generation(out: Path, chain: str, g: int, ids: Sequence[str]) -> list:
    """Captions or images of generation ``g`` of ``chain`` in ``ids`` order."""
    if modality(chain, g) == "text":
        path = out / chain / f"gen-{g}.csv"
        if not path.is_file():
            raise UserError(f"{path} not found: run the chains first (unicon evaluate drift ...)")
        caps = {name[:-4]: c for name, c in read_csv(path)}
        missing = [i for i in ids if i not in caps]
        if missing:
            raise ValueError(f"{path}: no row for {missing[:3]}")
        return [caps[i] for i in ids]
    images = []
    for i in ids:
        path = out / chain / f"gen-{g}" / f"{i}.png"
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (OSError, SyntaxError) as e:
            raise ValueError(f"{path}: cannot read image ({e})") from None
    return images


def fit_decay(gens: Sequence[float], values: Sequence[float]) -> dict[str, Any]:
    """Fit ``S(g) = a exp(-b g) + c`` (``b >= 0``); ``{"a","b","c","rmse"}`` or ``{"error": why}``."""
    x, y = np.asarray(gens, dtype=float), np.asarray(values, dtype=float)
    if len(x) < 3:
        return {"error": f"needs >= 3 generations, got {len(x)}"}
    if not np.all(np.isfinite(y)):
        return {"error": "non-finite similarities"}
    from scipy.optimize import OptimizeWarning, curve_fit
    import warnings

    def f(g, a, b, c):
        return a * np.exp(-b * g) + c

    p0 = (max(y[0] - y[-1], 1e-3), 0.5, y[-1])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", OptimizeWarning)
            (a, b, c), _ = curve_fit(f, x, y, p0=p0, bounds=([-np.inf, 0.0, -np.inf], [np.inf, 50.0, np.inf]),
                                     maxfev=20000)
    except (RuntimeError, ValueError, OptimizeWarning) as e:
        return {"error": f"curve_fit failed: {str(e).splitlines()[0]}"}
    rmse = float(np.sqrt(np.mean((f(x, a, b, c) - y) ** 2)))
    return {"a": float(a), "b": float(b), "c": float(c), "rmse": rmse}


def compute_mcd(out: str | Path, ids: Sequence[str], embedders: dict[str, Embedder], generations: int,
                chains: Sequence[str] = CHAINS) -> dict[str, Any]:
    """S_delta(g), MCD_delta per embedder and the headline MCD (see module docstring).

    Returns ``{"S": {mapping: {g: value}}, "MCD": {mapping: value}, "MCD_avg", "embedder": {mapping: name},
    "by_embedder": {name: {mapping: {"S", "MCD", "per_chain"}}}, "decay": {mapping: fit}}``.
    """
    out = Path(out)
    by_emb: dict[str, dict] = {}
    for name, emb in embedders.items():
        by_emb[name] = {}
        for mapping, (chain, parity, src, tgt) in MAPPINGS.items():
            if chain not in chains or not emb.supports(src, tgt):
                continue
            gens = [g for g in range(1, generations + 1) if g % 2 == parity]
            if not gens:
                continue
            inp = emb.embed(src, load_generation(out, chain, 0, ids))
            per_gen = []
            for g in gens:
                preemption.check()
                outs = emb.embed(tgt, load_generation(out, chain, g, ids))
                per_gen.append((inp * outs).sum(-1))  # cosine per chain (unit vectors)
            sims = torch.stack(per_gen, 1)  # [N, len(gens)]
            S = {g: float(v) for g, v in zip(gens, sims.mean(0).tolist())}
            by_emb[name][mapping] = {"S": S, "MCD": float(np.mean(list(S.values()))),
                                     "per_chain": [[round(v, 6) for v in row] for row in sims.tolist()]}
    result: dict[str, Any] = {"S": {}, "MCD": {}, "embedder": {}, "decay": {}, "by_embedder": by_emb}
    for mapping in MAPPINGS:
        for name in PREFERRED[mapping] + tuple(embedders):
            if mapping in by_emb.get(name, {}):
                entry = by_emb[name][mapping]
                result["S"][mapping], result["MCD"][mapping] = entry["S"], entry["MCD"]
                result["embedder"][mapping] = name
                result["decay"][mapping] = fit_decay(list(entry["S"]), list(entry["S"].values()))
                break
    result["MCD_avg"] = float(np.mean(list(result["MCD"].values()))) if result["MCD"] else float("nan")
    return result


# ---------------------------------------------------------------------------------------------------------
# MGG
# ---------------------------------------------------------------------------------------------------------
def compute_mgg(out: str | Path, seeds: Sequence[DriftSeed], generations: int, detector) -> dict[str, Any]:
    """GenEval of every image generation of the text-first chains in ``out`` (seeds carry ``geneval``)."""
    from unicon.evaluation.geneval import score_images

    missing = [s.id for s in seeds if s.geneval is None]
    if missing:
        raise UserError(f"MGG needs GenEval seeds; {missing[:3]} carry no GenEval metadata")
    out, ids = Path(out), [s.id for s in seeds]
    prompts = [s.geneval for s in seeds]
    per_gen = {}
    for g in range(1, generations + 1, 2):
        preemption.check()
        images = load_generation(out, "text-first", g, ids)
        summary, results = score_images(prompts, images, detector)
        summary["correct"] = [r.correct for r in results]
        per_gen[g] = summary
    if not per_gen:
        raise UserError("MGG needs at least one image generation (generations >= 1)")
    return {
        "per_generation": per_gen,
        "MGG": float(np.mean([v["overall"] for v in per_gen.values()])),
        "MGG_micro": float(np.mean([v["overall_micro"] for v in per_gen.values()])),
    }


# ---------------------------------------------------------------------------------------------------------
# Plots and tables
# ---------------------------------------------------------------------------------------------------------
def plot_curves(mcd: dict, path: Path, title: str = "") -> Path:
    """S_delta(g) per mapping (one panel each, one line per embedder), like the paper's Fig. 6."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), squeeze=False)
    for ax, mapping in zip(axes[0], MAPPINGS):
        chain, _, src, tgt = MAPPINGS[mapping]
        for name, per in mcd["by_embedder"].items():
            if mapping in per:
                S = per[mapping]["S"]
                label = f"{name} (MCD {per[mapping]['MCD']:.3f})"
                ax.plot(list(S), list(S.values()), marker="o", label=label)
        fit = mcd["decay"].get(mapping, {})
        if "b" in fit and mapping in mcd["S"]:
            xs = np.linspace(min(mcd["S"][mapping]), max(mcd["S"][mapping]), 50)
            ys = fit["a"] * np.exp(-fit["b"] * xs) + fit["c"]
            ax.plot(xs, ys, "k--", lw=1, label=f"fit b={fit['b']:.2f}")
        values = [v for line in ax.lines for v in line.get_ydata()]
        ax.set_ylim(min([0.0, *values]) - 0.02, 1.02)
        ax.set_title(f"{chain}: {src} -> {tgt}")
        ax.set_xlabel("generation g")
        ax.set_ylabel("S(g)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title or f"MCD_avg = {mcd['MCD_avg']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_mgg_heatmap(mgg: dict, path: Path) -> Path:
    """Task x generation accuracy heatmap, like the paper's Fig. 11."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gens = sorted(mgg["per_generation"])
    tasks = list(next(iter(mgg["per_generation"].values()))["tasks"])
    grid = np.array([[mgg["per_generation"][g]["tasks"].get(t, np.nan) for g in gens] for t in tasks])
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(gens), 0.8 + 0.5 * len(tasks)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(gens)), [str(g) for g in gens])
    ax.set_yticks(range(len(tasks)), tasks)
    for r in range(len(tasks)):
        for c in range(len(gens)):
            ax.text(c, r, f"{grid[r, c]:.2f}", ha="center", va="center", fontsize=7,
                    color="k" if grid[r, c] > 0.6 else "w")
    ax.set_xlabel("generation")
    ax.set_title(f"MGG = {mgg['MGG']:.3f}")
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chain_strip(
    out: Path, chain: str, id_: str, generations: int, thumb: int = 128
) -> tuple[Image.Image, list[str]]:
    """One chain as a horizontal strip of its images (thumbnails) and its captions by generation."""
    images, captions = [], []
    for g in range(generations + 1):
        item = load_generation(out, chain, g, [id_])[0]
        if isinstance(item, str):
            captions.append(f"g{g}: {item}")
        else:
            images.append(item.resize((thumb, thumb)))
    strip = Image.new("RGB", (max(1, len(images)) * (thumb + 4), thumb), "white")
    for k, im in enumerate(images):
        strip.paste(im, (k * (thumb + 4), 0))
    return strip, captions


def plot_strips(out: Path, ids: Sequence[str], generations: int, path: Path, chains: Sequence[str] = CHAINS,
                max_gens: int = 8) -> Path:
    """Images and captions across generations for a few chains (the picture a person wants to see)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import textwrap

    G = min(generations, max_gens)
    rows = [(c, i) for c in chains for i in ids]
    fig, axes = plt.subplots(len(rows), G + 1, figsize=(2.2 * (G + 1), 2.6 * len(rows)), squeeze=False)
    for r, (chain, id_) in enumerate(rows):
        for g in range(G + 1):
            ax = axes[r][g]
            ax.axis("off")
            item = load_generation(out, chain, g, [id_])[0]
            if isinstance(item, str):
                ax.text(0.0, 0.5, "\n".join(textwrap.wrap(item, 28)[:9]), fontsize=6, va="center", wrap=True)
            else:
                ax.imshow(item)
            ax.set_title(f"{chain} {id_[:16]} g0" if g == 0 else f"g{g}", fontsize=7)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.95, bottom=0.01, wspace=0.05, hspace=0.25)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def strip_rows(out: Path, ids: Sequence[str], generations: int, chains: Sequence[str]) -> list[list]:
    rows = []
    for chain in chains:
        for i in ids:
            strip, caps = chain_strip(out, chain, i, generations)
            rows.append([chain, i, strip, "\n".join(caps)])
    return rows


# ---------------------------------------------------------------------------------------------------------
# Embedders and the whole evaluation
# ---------------------------------------------------------------------------------------------------------
def load_embedders(names: Sequence[str], clip: str | None = None, dino: str | None = None,
                   sentence: str | None = None, world=None, strict: bool = True) -> dict[str, Embedder]:
    """Build the named embedders (``scene``, ``clip``, ``text``/``sentence``, ``dino``).

    ``strict=False`` logs a missing embedder (with the path looked for) and skips it instead of raising.
    """
    from unicon.embedders.base import EmbedderNotFound

    out: dict[str, Embedder] = {}
    for name in names:
        try:
            if name == "scene":
                if world is None:
                    raise UserError("the scene embedder needs a ShapesWorld (give --world DIR)")
                from unicon.embedders.scene import SceneEmbedder

                out["scene"] = SceneEmbedder(world.config)
            elif name == "clip":
                from unicon.embedders.clip import ClipEmbedder

                if clip is None:
                    raise EmbedderNotFound("no CLIP model given: pass --clip DIR (or eval.drift.clip=DIR); "
                                           "for ShapesWorld train one with `python -m unicon.embedders.clip "
                                           "--train-shapes data/shapes --out checkpoints/shapes_clip`")
                out["clip"] = ClipEmbedder(clip)
            elif name in ("text", "sentence"):
                from unicon.embedders.sentence import SentenceEmbedder

                out["text"] = SentenceEmbedder(sentence)
            elif name == "dino":
                from unicon.embedders.dino import DinoEmbedder, HINT

                if dino is None:
                    raise EmbedderNotFound(f"no DINO model given (--dino DIR): {HINT}")
                out["dino"] = DinoEmbedder(dino)
            else:
                raise UserError(f"unknown embedder {name!r}; use scene, clip, text, dino")
        except EmbedderNotFound as e:
            if strict:
                raise
            log.warning("drift: skipping the %s embedder: %s", name, e)
    return out


def evaluate_drift(
    model: UnifiedModel, out: str | Path, seeds: Sequence[DriftSeed] | None = None,
    geneval_seeds: Sequence[DriftSeed] | None = None, generations: int = 20, batch_size: int = 8,
    i2t_prompt: str | None = None, embedders: dict[str, Embedder] | None = None, detector=None,
    chains: Sequence[str] = CHAINS, image_config: ImageGenerationConfig | None = None, strips: int = 3,
    seed: int = 0, model_id: dict | None = None, geneval_file: str | None = None,
) -> dict[str, Any]:
    """Run/resume the chains, compute MCD (``seeds``) and MGG (``geneval_seeds`` + ``detector``), write
    ``drift.json`` and the plots into ``out``. Returns the drift.json content.

    ``model_id`` (``{"checkpoint", "fingerprint"}``) is recorded in ``drift.json`` and in each chain
    folder's ``run.json``, and a resume under other weights is refused; ``geneval_file`` names the
    GenEval metadata file the MGG prompts come from."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"generations": generations, "i2t_prompt": i2t_prompt, "repairs": []}
    if model_id:
        report.update(checkpoint=model_id["checkpoint"], model_fingerprint=model_id["fingerprint"])
    if geneval_seeds:
        report["geneval_file"] = geneval_file
    common = dict(generations=generations, batch_size=batch_size, i2t_prompt=i2t_prompt,
                  image_config=image_config, seed=seed, model_id=model_id)
    if seeds:
        run = run_chains(model, seeds, out / "mcd", chains=chains, **common)
        report["repairs"] += run.repairs
        report["num_chains"] = len(run.ids)
        if embedders:
            mcd = compute_mcd(out / "mcd", run.ids, embedders, generations, chains)
            report["mcd"] = mcd
            report["MCD_avg"], report["MCD"] = mcd["MCD_avg"], mcd["MCD"]
            plot_curves(mcd, out / "drift_curves.png")
        if strips:
            plot_strips(out / "mcd", run.ids[:strips], generations, out / "strips.png", chains=chains)
        report["strip_ids"] = run.ids[:strips]
    if geneval_seeds:
        if detector is None:
            raise UserError("MGG needs a detector (shapes or owlv2:<path>)")
        run = run_chains(model, geneval_seeds, out / "mgg", chains=("text-first",), **common)
        report["repairs"] += run.repairs
        mgg = compute_mgg(out / "mgg", geneval_seeds, generations, detector)
        report["mgg"] = mgg
        report["MGG"], report["MGG_micro"] = mgg["MGG"], mgg["MGG_micro"]
        plot_mgg_heatmap(mgg, out / "mgg_heatmap.png")
    atomic_write(out / "drift.json", json.dumps(report, indent=1, default=float).encode())
    return report


def drift_metrics(report: dict[str, Any], prefix: str = "drift") -> dict[str, float]:
    """Flat scalars for loggers: MCD_avg, MCD_<mapping>, <embedder>/MCD_<mapping>, MGG, per-task MGG."""
    m: dict[str, float] = {}
    if "mcd" in report:
        m[f"{prefix}/MCD_avg"] = report["MCD_avg"]
        for k, v in report["MCD"].items():
            m[f"{prefix}/MCD_{k}"] = v
        for name, per in report["mcd"]["by_embedder"].items():
            for k, v in per.items():
                m[f"{prefix}/{name}/MCD_{k}"] = v["MCD"]
        for k, fit in report["mcd"]["decay"].items():
            if "b" in fit:
                m[f"{prefix}/drift_rate_{k}"] = fit["b"]
    if "mgg" in report:
        m[f"{prefix}/MGG"] = report["MGG"]
        m[f"{prefix}/MGG_micro"] = report["MGG_micro"]
        gens = report["mgg"]["per_generation"]
        tasks = {t for v in gens.values() for t in v["tasks"]}
        for t in sorted(tasks):
            m[f"{prefix}/MGG_{t}"] = float(np.mean([v["tasks"][t] for v in gens.values() if t in v["tasks"]]))
    return m


#: the plots of :func:`evaluate_drift`, logged as ``drift/fig/<name>`` (those written)
FIGURES = ("drift_curves", "mgg_heatmap", "strips")


def log_plots(
    loggers, report: dict[str, Any], out: Path, step: int | None = None, prefix: str = "drift"
) -> None:
    """W&B line plots of S_delta(g) and GenEval overall by generation, the figures in ``out``
    (:data:`FIGURES`, as ``<prefix>/fig/<name>`` images) and the chain-strip table (``log_table``: a
    ``wandb.Table`` on W&B, ``tables/<key>.jsonl`` + PNGs for other loggers)."""
    from lightning.pytorch.loggers import WandbLogger

    if any(isinstance(lg, WandbLogger) for lg in loggers):
        import wandb

        plots = {}
        for mapping, S in report.get("mcd", {}).get("S", {}).items():
            table = wandb.Table(data=[[g, v] for g, v in S.items()], columns=["generation", "S"])
            plots[f"{prefix}/S_{mapping}"] = wandb.plot.line(table, "generation", "S",
                                                             title=f"S_{mapping}(g)")
        if "mgg" in report:
            data = [[g, v["overall"]] for g, v in report["mgg"]["per_generation"].items()]
            table = wandb.Table(data=data, columns=["generation", "GenEval overall"])
            plots[f"{prefix}/MGG_by_generation"] = wandb.plot.line(table, "generation", "GenEval overall",
                                                                  title="GenEval overall by generation")
        log_wandb(loggers, plots, step=step)
    log_figures(loggers, prefix, out, FIGURES, step=step)
    if report.get("strip_ids"):
        chains = [c for c in CHAINS if (out / "mcd" / c).is_dir()]
        rows = strip_rows(out / "mcd", report["strip_ids"], report["generations"], chains)
        log_table(loggers, f"{prefix}/strips", ["chain", "id", "images", "captions"], rows, step=step)


# ---------------------------------------------------------------------------------------------------------
# Epoch-end callback
# ---------------------------------------------------------------------------------------------------------
class DriftCallback(EvalCallback):
    """A small drift run at the end of training epochs: ``drift/MCD_avg``, ``drift/MCD_<mapping>``,
    ``drift/MGG``.

    ``cfg`` is ``eval.drift`` (``DriftEvalConfig``); ``world_root`` the ShapesWorld directory. Seeds
    default to the world's ``drift_seeds.jsonl`` (first ``num_chains``) and ``geneval_metadata.jsonl``
    (``num_chains`` prompts spread over the tasks); embedders missing on disk are skipped with a warning.
    """

    name = "drift"

    def __init__(
        self, cfg, world_root: str | Path, every_n_epochs: int | None = None, fail_on_error: bool = False
    ):
        super().__init__(every_n_epochs or cfg.every_n_epochs, fail_on_error)
        self.cfg, self.world_root = cfg, Path(world_root)
        self._embedders: dict[str, Embedder] | None = None

    def evaluate(self, trainer, model) -> dict[str, float]:
        if getattr(trainer, "global_rank", 0) != 0:
            # Chains write one directory; under DDP rank 0 runs them all (models must not need collectives
            # in forward, i.e. no FSDP / ZeRO-3 sharding) and the loggers are rank-zero anyway.
            return {}
        from unicon.data.drift_seeds import balanced, geneval_seeds, load_seeds
        from unicon.evaluation.geneval import ShapesDetector
        from unicon.worlds.shapes import load_world

        world = load_world(self.world_root)
        cfg = self.cfg
        seeds = load_seeds(cfg.seeds or world.drift_seeds_path)[: cfg.num_chains]
        gseeds, detector = None, None
        if cfg.geneval:
            path = cfg.geneval_prompts or world.geneval_path
            gseeds = balanced(geneval_seeds(path, long=cfg.long_prompts, tasks=None), cfg.num_chains)
            detector = ShapesDetector(world.config)
        if self._embedders is None:
            self._embedders = load_embedders(cfg.embedders, clip=cfg.clip, dino=cfg.dino,
                                             sentence=cfg.sentence, world=world, strict=False)
        out = self.output_dir(trainer)
        report = evaluate_drift(
            model, out, seeds=seeds, geneval_seeds=gseeds, generations=cfg.generations,
            batch_size=cfg.batch_size, i2t_prompt=cfg.i2t_prompt, embedders=self._embedders,
            detector=detector, strips=cfg.strips,
        )
        log_plots(trainer.loggers, report, out, step=trainer.global_step)
        return drift_metrics(report)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", default="data/shapes",
                   help="ShapesWorld root (scene embedder, shapes detector, default seeds)")
    p.add_argument("--seeds", help="ShapesWorld drift_seeds.jsonl / world dir, or a GenEval metadata file "
                                   "(default: the world's drift seeds)")
    p.add_argument("--num-chains", type=int, default=None, help="use only the first N seeds")
    p.add_argument("--generations", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--i2t-prompt", default=None,
                   help='captioning prompt, e.g. "Describe the image in detail." (default: the backend\'s)')


def _load_model(ckpt: str | None) -> UnifiedModel:
    if not ckpt:
        raise UserError("--ckpt is required (a save_pretrained directory or a Lightning .ckpt)")
    if not Path(ckpt).exists():
        raise UserError(f"checkpoint not found: {ckpt}")
    from unicon.models import load_model

    return load_model(ckpt)


def cli(argv: Sequence[str] | None = None) -> int:
    """``unicon evaluate drift --ckpt ... --seeds ... --generations 20 --out DIR``."""
    p = argparse.ArgumentParser(
        prog="unicon evaluate drift",
        description="Semantic drift chains: run/resume I2T<->T2I chains, compute MCD and MGG.",
    )
    add_common_args(p, out_help="output directory (resumable)")
    _add_common(p)
    p.add_argument("--chains", default="both", choices=["both", "text-first", "image-first"])
    p.add_argument("--nocaps", help="ND400: nocaps_val_4500_captions.json (use instead of --seeds)")
    p.add_argument("--nocaps-images", help="ND400: folder of NoCaps val images")
    p.add_argument("--docci", help="ND400: docci_descriptions.jsonlines")
    p.add_argument("--docci-images", help="ND400: folder of DOCCI images")
    p.add_argument("--nd-n", type=int, default=200, help="ND400: pairs drawn from each source (200 -> 400)")
    p.add_argument("--embedders", default="scene,clip,text",
                   help="comma list of scene, clip, text, dino ('' = none)")
    p.add_argument("--clip", default=DriftEvalConfig.clip,
                   help="open_clip dir, '<arch>:<weights file>' or hf-hub:<repo> (the default ShapesWorld CLIP is "
                        "skipped with a warning when it has not been trained)")
    p.add_argument("--dino", default=None, help="DINO model directory (transformers)")
    p.add_argument("--sentence", default=None,
                   help="sentence-transformers dir (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--geneval", default=None,
                   help="GenEval metadata file for MGG (default: the world's, if any; 'none' skips MGG)")
    p.add_argument("--long", action="store_true", help="use the long 'detailed_caption' GenEval prompts")
    p.add_argument("--geneval-limit", type=int, default=None, help="first N prompts of every task")
    p.add_argument("--detector", default="shapes", help="'shapes' or 'owlv2:<dir>'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from unicon.data.drift_seeds import balanced, geneval_seeds, is_geneval_file, load_seeds, nd400_seeds
    from unicon.evaluation.geneval import ClipColorClassifier, check_detector_spec, load_detector

    check_common_args(args, ("num_chains", "generations", "batch_size", "nd_n", "geneval_limit"))
    check_detector_spec(args.detector)

    world = None
    if Path(args.world, "world.json").is_file():
        from unicon.worlds.shapes import load_world

        world = load_world(args.world)
    if args.nocaps or args.docci:
        if not all([args.nocaps, args.nocaps_images, args.docci, args.docci_images]):
            raise UserError("ND400 needs --nocaps, --nocaps-images, --docci and --docci-images")
        seeds = nd400_seeds(args.nocaps, args.nocaps_images, args.docci, args.docci_images,
                            n=args.nd_n, seed=args.seed)
    elif args.seeds:
        seeds = load_seeds(args.seeds, long=args.long)
    elif world is not None:
        seeds = load_seeds(world.drift_seeds_path)
    else:
        raise UserError(f"no seeds: give --seeds FILE or a built world (no {args.world}/world.json)")
    if args.num_chains:
        seeds = seeds[: args.num_chains]
    chains = CHAINS if args.chains == "both" else (args.chains,)
    if any(s.image is None for s in seeds):  # prompt-only seeds (GenEval): text-first only
        chains = ("text-first",)

    names = [n for n in args.embedders.split(",") if n]
    if world is None and "scene" in names:
        names.remove("scene")
    if "clip" in names and args.clip == DriftEvalConfig.clip and not Path(args.clip).exists():
        log.warning("drift: no CLIP model at the default %s (train one with `python -m unicon.embedders.clip "
                    "--train-shapes data/shapes --out %s`); the CLIP mappings are skipped", args.clip, args.clip)
        names.remove("clip")
    embedders = load_embedders(names, clip=args.clip, dino=args.dino, sentence=args.sentence, world=world)

    gseeds, detector = None, None
    gpath = args.geneval
    if gpath is None and args.seeds and is_geneval_file(args.seeds):
        gpath = args.seeds  # MGG scores the prompts of the GenEval file given as seeds
    elif gpath is None and not args.seeds and world is not None and world.geneval_path.is_file():
        gpath = str(world.geneval_path)
    if gpath and gpath != "none":
        gseeds = geneval_seeds(gpath, long=args.long, limit=args.geneval_limit, tasks=None)
        if args.num_chains and not args.geneval_limit:
            gseeds = balanced(gseeds, args.num_chains)
        color = None
        if args.detector != "shapes" and "clip" in embedders:
            color = ClipColorClassifier(embedders["clip"])
        detector = load_detector(args.detector, world_cfg=world.config if world else None,
                                 color_classifier=color)

    from unicon.models import weights_fingerprint

    model = load_model_for(args)
    out = Path(args.out)
    model_id = {"checkpoint": str(Path(args.ckpt).resolve()), "fingerprint": weights_fingerprint(model)}
    with preemption.watch_signals():  # stops at the next batch; the journals make a rerun resume
        report = evaluate_drift(model, out, seeds=seeds, geneval_seeds=gseeds, generations=args.generations,
                                batch_size=args.batch_size, i2t_prompt=args.i2t_prompt, embedders=embedders,
                                detector=detector, chains=chains, seed=args.seed, model_id=model_id,
                                geneval_file=str(Path(gpath).resolve()) if gseeds else None)
    if args.logger != "none":
        from omegaconf import OmegaConf

        from unicon.training.loggers import make_loggers

        lcfg = OmegaConf.create({"type": args.logger, "project": None, "entity": None, "mode": None,
                                 "tags": ["drift"]})
        loggers = make_loggers(lcfg, out, name=f"drift-{out.name}")
        log_eval_config(loggers, args, model_id["fingerprint"])
        log_metrics(loggers, drift_metrics(report), step=0)
        log_plots(loggers, report, out, step=0)
        for lg in loggers:
            lg.finalize("success")
    summary = {k: report[k] for k in ("MCD_avg", "MCD", "MGG", "MGG_micro") if k in report}
    summary["out"] = str(out)
    summary["repairs"] = len(report["repairs"])
    print(json.dumps(summary, indent=1))
    return 0


def _time_image_codes(model, texts: list[str], cfg: ImageGenerationConfig, num_steps: int, codebook_size: int,
                      repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` seconds for the first ``num_steps`` codes of ``texts`` with the decoder's
    KV cache and with the full-prefix recompute (the two alternate within each repeat, in one
    process), and whether both gave the same codes (they must: same seed, logits equal up to
    rounding)."""
    best = {"cached": math.inf, "uncached": math.inf}
    codes = {}
    for _ in range(max(repeats, 1)):
        for label in best:
            start = time.perf_counter()
            codes[label] = model._generate_image_codes(texts, cfg, num_steps, codebook_size,
                                                       use_cache=label == "cached")[0]
            best[label] = min(best[label], time.perf_counter() - start)
    out: dict[str, Any] = {}
    for label, seconds in best.items():
        out[f"{label}_seconds"] = seconds
        out[f"{label}_codes_per_s"] = len(texts) * num_steps / seconds
    out["speedup"] = best["uncached"] / best["cached"]
    out["identical_codes"] = bool(torch.equal(codes["cached"], codes["uncached"]))
    return out


def _time_last_code(model, text: str, num_codes: int, codebook_size: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` seconds of the decoder pass that yields the last code of a full grid:
    the newest token against a cache of the ``num_codes - 1`` tokens before it, vs the whole
    ``num_codes``-token prefix (the work each path does per code at the end of an image). The
    prefix codes are random: timing does not depend on their values."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from unicon.models.ofa.tokenization import BOS_ID

    lo = model.tokenizer.code_offset
    codes = torch.randint(codebook_size, (1, num_codes - 1), generator=torch.Generator().manual_seed(0))
    prefix = torch.cat([torch.full((1, 1), BOS_ID), codes + lo], dim=1).to(model.device)
    enc = model.encode(model._source_ids([text]))
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    model.decode(prefix[:, :-1], enc, code_mode=True, past_key_values=cache)  # prefill, not timed
    best = {"cached": math.inf, "uncached": math.inf}
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        model.decode(prefix[:, -1:], enc, code_mode=True, past_key_values=cache)
        best["cached"] = min(best["cached"], time.perf_counter() - start)
        cache.crop(-1)  # back to num_codes - 1 cached tokens
        start = time.perf_counter()
        model.decode(prefix, enc, code_mode=True)
        best["uncached"] = min(best["uncached"], time.perf_counter() - start)
    return {"cache_length": num_codes - 1, "cached_seconds": best["cached"],
            "uncached_seconds": best["uncached"], "speedup": best["uncached"] / best["cached"]}


@torch.no_grad()
def bench_t2i_cache(model: UnifiedModel, source: str, prompts: Sequence[str], batch_size: int,
                    base_codes: int, repeats: int = 1, device: torch.device | str = "cpu") -> dict[str, Any]:
    """OFA text-to-image with the decoder's KV cache vs the full recompute, side by side.

    * ``chain_model``: the chains' ``model`` (named by ``source``; an OFA model with an image
      tokenizer, by default the 4x4 ShapesWorld one) draws its whole code grid for ``batch_size``
      prompts with its own ``image_generation`` settings.
    * ``ofa_base``: ``configs/model/ofa_base.yaml``'s preset with random weights (nothing is
      loaded) at OFA's image-generation code grid (``code_image_size`` 256: 32x32 = 1,024 codes,
      8,192-code block, the published 59,457-token vocabulary), one prompt, sampling. Without a
      cache every step reruns the decoder on the whole prefix, so its cost grows with the square
      of the codes drawn; only the first ``base_codes`` codes are timed (``0`` skips it), plus the
      single decoder pass for the grid's last code (``last_code``) both ways.
    """
    from unicon.models.ofa.unified import OFAUnifiedModel

    result: dict[str, Any] = {}
    if isinstance(model, OFAUnifiedModel) and model.image_tokenizer is not None:
        h, w = model.image_tokenizer.grid_size
        texts = [model._t2i_text(p) for p in prompts[:batch_size]]
        cfg = dataclasses.replace(model.image_generation_config, seed=0)
        result["chain_model"] = {"source": source, "grid": [h, w], "codes_timed": h * w,
                                 "batch_size": len(texts), "generation": asdict(cfg),
                                 **_time_image_codes(model, texts, cfg, h * w,
                                                     model.image_tokenizer.codebook_size, repeats)}
    else:
        why = f"{type(model).__name__} is not an OFA model with an image tokenizer"
        result["chain_model"] = {"source": source, "skipped": why}
    if base_codes > 0:
        from unicon.config import compose
        from unicon.models.ofa.configuration_ofa import preset_config
        from unicon.models.ofa.modeling_ofa import OFAModel
        from unicon.models.ofa.tokenization import OFATokenizer
        from unicon.models.ofa.unified import OFAWrapperConfig

        preset = compose(["model=ofa_base"]).model.preset
        config = preset_config(preset, code_image_size=256)  # OFA's image generation: 256 px / 8 = 32x32
        grid = config.code_image_size // 8
        num_codes = grid * grid
        if base_codes > num_codes:
            raise UserError(f"--t2i-base-codes {base_codes} exceeds the {grid}x{grid} grid's "
                            f"{num_codes} codes")
        torch.manual_seed(0)
        base = OFAUnifiedModel(OFAModel(config), OFATokenizer.byte_level(config.vocab_size, num_codes=8192),
                               OFAWrapperConfig(max_source_length=128)).to(device).eval()
        cfg = ImageGenerationConfig(do_sample=True, seed=0)
        result["ofa_base"] = {"preset": preset, "random_weights": True, "grid": [grid, grid],
                              "codes_timed": base_codes, "codes_per_image": num_codes, "batch_size": 1,
                              "generation": asdict(cfg),
                              **_time_image_codes(base, [base._t2i_text(prompts[0])], cfg, base_codes, 8192,
                                                  repeats)}
        result["ofa_base"]["last_code"] = _time_last_code(base, base._t2i_text(prompts[0]), num_codes, 8192,
                                                          repeats)
        if base_codes < num_codes:
            result["ofa_base"]["note"] = (
                f"both paths timed on the first {base_codes} of {num_codes} codes (--t2i-base-codes): the "
                "uncached decoder reruns the whole prefix at every code, so a full image would take it "
                "tens of minutes on a CPU; the speed-up grows with the number of codes (last_code: the "
                "decoder pass for the final code of a full image, timed both ways)")
        del base
    return result


def bench_cli(argv: Sequence[str] | None = None) -> int:
    """``unicon bench chains``: generation steps/s with batched chains vs one chain at a time, and
    OFA text-to-image with vs without the decoder's KV cache (:func:`bench_t2i_cache`)."""
    p = argparse.ArgumentParser(
        prog="unicon bench chains",
        description="Throughput of drift chains: batched across samples vs one chain at a time; OFA "
                    "text-to-image with vs without the decoder's KV cache.",
    )
    _add_common(p)
    p.add_argument("--ckpt", default=None, help="a trained checkpoint (default: --model with random weights)")
    p.add_argument("--model", default="ofa_shapes_tiny",
                   help="without --ckpt: a config name under configs/model/ built with random weights")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--t2i-base-codes", type=int, default=64,
                   help="image codes timed with and without the KV cache on a random-weight ofa_base "
                        "(32x32 = 1024 codes per image; 0 skips it; default: %(default)s)")
    p.set_defaults(generations=2, num_chains=8)
    args = p.parse_args(argv)

    from unicon.data.drift_seeds import load_seeds

    seeds = load_seeds(args.seeds or Path(args.world))[: args.num_chains]
    if args.ckpt:
        model = _load_model(args.ckpt)
    else:
        from unicon.config import compose
        from unicon.models import build_model

        cfg = compose([f"model={args.model}", f"data.root={args.world}"])
        model = build_model(cfg.model, world_root=args.world)
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device
    result = {"num_chains": len(seeds), "generations": args.generations, "chains": list(CHAINS),
              "device": str(device), "torch_threads": torch.get_num_threads()}
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for label, bs in (("batched", min(args.batch_size, len(seeds))), ("sequential", 1)):
            best = math.inf
            for r in range(args.repeats):
                d = Path(tmp) / f"{label}-{r}"
                run = run_chains(model, seeds, d, generations=args.generations, batch_size=bs,
                                 i2t_prompt=args.i2t_prompt)
                best = min(best, run.model_seconds)
                shutil.rmtree(d)
            steps = len(seeds) * args.generations * len(CHAINS)
            result[f"{label}_steps_per_s"] = steps / best
            result[f"{label}_seconds"] = best
            result[f"{label}_batch_size"] = bs
    result["speedup"] = result["batched_steps_per_s"] / result["sequential_steps_per_s"]
    prompts = [s.caption for s in seeds if s.caption] or ["a red circle"]
    source = args.ckpt or f"model={args.model} (random weights)"
    result["t2i_kv_cache"] = bench_t2i_cache(model, source, prompts, min(args.batch_size, len(prompts)),
                                             args.t2i_base_codes, args.repeats, device)
    print(json.dumps(result))
    return 0

