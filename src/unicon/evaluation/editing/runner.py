"""EditingScore over samples (and over the model's own edits), per-sample records and files, sharded.

For each batch of samples: ``z_s = model.image_latents(sources)``, ``z_t = model.image_latents(edited)``,
``f^ = model.embed_image(edited)``, ``p = model.embed_text(instructions)``, then
:func:`~.metrics.editing_components`. Rank ``r`` (or shard ``r/n``) scores
:func:`~unicon.evaluation.distributed.shard_indices` of the samples; the records are gathered, and rank 0
(or the merge) writes::

    samples.jsonl     one row per sample: id, instruction, source_image, edited_image, ratings (usable ones),
                      cos_image, sim_text, rls, score, no_cos, no_sim_text, no_rls (+ judge_score,
                      judge_reply with a judge), + the row's extra keys
    editing.json      {"results": metrics.summarize(...), **info}: Kendall tau_b/tau_c of the score, each
                      ablation, each component (and the judge) vs every criterion; n, skipped ratings,
                      direction; Table 2's Pearson matrix (``pearson``), Table 3 (``table3``)
    table.md          the tau_b table, Table 2 and Table 3
    tau_by_variant.png, score_vs_rating.png

With a ``judge`` (:mod:`.judges`: the Table 3 baseline) each batch is also rated by it, on the same
rank / shard as its scores. With ``own_edits`` > 0 (a ShapesWorld root): the first N rows of ``edit_test.jsonl`` are edited by
``model.edit_image`` (``image_config``), each edit is checked exactly against its target scene
(:func:`~unicon.worlds.shapes_edit.edit_matches`) and scored by EditingScore against its source; rows go
to ``own_edits.jsonl`` (edited images under ``own_edits/``) and per-kind means beside the exact-match rate
to ``editing.json["own_edits"]``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from unicon.config import EditingEvalConfig
from unicon.data.mixture import read_edits
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.distributed import gather_records, owned_indices, shard_indices, writes_outputs
from unicon.evaluation.editing.data import CRITERIA, EditSample, rating_or_none
from unicon.evaluation.editing.metrics import (COMPONENTS, CORRELATED, EPS, VARIANTS, editing_components, group_means,
                                               kendall_row, summarize)
from unicon.evaluation.editing.plots import plot_results
from unicon.evaluation.framework import eval_mode, write_jsonl, write_results
from unicon.models.base import ImageGenerationConfig, UnifiedModel

BATCH_SIZE = EditingEvalConfig.batch_size  # samples per model call: the eval section's default


def check_model(model: UnifiedModel) -> None:
    """Refuse, before any work, a backend without the three embedding methods (one line naming it)."""
    name = model._backend_name()
    for method in ("image_latents", "embed_image", "embed_text"):
        if getattr(type(model), method) is getattr(UnifiedModel, method):
            raise UserError(f"EditingScore needs {method}, and the {name} backend does not implement it "
                            "(UnifiedModel.image_latents / embed_image / embed_text)")


@torch.no_grad()
def score_images(model: UnifiedModel, sources: list, edited: list, instructions: Sequence[str],
                 eps: float = EPS) -> dict[str, list[float]]:
    """The components of :func:`~.metrics.editing_components` for one batch, as float lists."""
    values = editing_components(model.image_latents(sources).cpu(), model.image_latents(edited).cpu(),
                                model.embed_image(edited).cpu(), model.embed_text(list(instructions)).cpu(), eps)
    return {k: v.tolist() for k, v in values.items()}


def sample_record(s: EditSample, values: dict[str, float], root: Path | None) -> dict[str, Any]:
    def rel(p: Path) -> str:
        try:
            return str(p.relative_to(root)) if root is not None else str(p)
        except ValueError:
            return str(p)

    rec: dict[str, Any] = {"id": s.id, "instruction": s.instruction, "source_image": rel(s.source_image),
                           "edited_image": rel(s.edited_image),
                           "ratings": {c: rating_or_none(s.ratings[c]) for c in CRITERIA if c in s.ratings}}
    rec.update({k: values[k] for k in (*COMPONENTS, *VARIANTS)})
    rec.update({k: values[k] for k in ("judge_score", "judge_reply") if k in values})
    for k, v in s.extra.items():
        rec.setdefault(k, v)
    return rec


#: the columns of the samples table (W&B, tables/editing_samples.jsonl)
TABLE_COLUMNS = ["id", "instruction", "source", "edited", "cos_image", "sim_text", "rls", "score", "overall"]


def table_rows(records: Sequence[dict], samples: Sequence[EditSample], limit: int | None = None) -> list[list[Any]]:
    """The first ``limit`` records as table rows, the source and edited images as PIL images."""
    by_id = {s.id: s for s in samples}
    rows = []
    for r in records[:limit] if limit is not None else records:
        s = by_id.get(r["id"])
        if s is None:
            continue
        with Image.open(s.source_image) as a, Image.open(s.edited_image) as b:
            images = [a.convert("RGB"), b.convert("RGB")]
        rows.append([r["id"], r["instruction"], *images, *(r.get(k) for k in ("cos_image", "sim_text", "rls", "score")),
                     (r.get("ratings") or {}).get("overall")])
    return rows


def skipped_counts(samples: Sequence[EditSample]) -> dict[str, dict[str, int]]:
    """Per criterion: rows without the key (``missing``) and with an unusable value (``invalid``: null, NaN,
    not a number, outside [0, 1]). A criterion no row has is all ``missing``."""
    out = {}
    for c in CRITERIA:
        missing = sum(1 for s in samples if c not in s.ratings)
        invalid = sum(1 for s in samples if c in s.ratings and rating_or_none(s.ratings[c]) is None)
        out[c] = {"missing": missing, "invalid": invalid}
    return out


def _score_samples(model, samples: Sequence[EditSample], indices: list[int], batch_size: int, eps: float,
                   judge=None) -> dict[int, dict]:
    values: dict[int, dict] = {}
    for chunk in preemption.batches(indices, batch_size, "editing: EditingScore"):
        batch = [samples[i] for i in chunk]
        sources, edited = [s.image("source") for s in batch], [s.image("edited") for s in batch]
        instructions = [s.instruction for s in batch]
        out = score_images(model, sources, edited, instructions, eps)
        if judge is not None:
            rated = judge.rate(sources, edited, instructions)
            out["judge_score"], out["judge_reply"] = [r.score for r in rated], [r.reply for r in rated]
        for k, i in enumerate(chunk):
            values[i] = {key: out[key][k] for key in out}
    return values


# ---- the model's own edits (ShapesWorld) ------------------------------------------------------
def own_edit_rows(world_root: str | Path, n: int) -> list[dict]:
    """The first ``n`` rows of ``<world_root>/edit_test.jsonl`` (:func:`unicon.data.mixture.read_edits`:
    a malformed row is an error naming its line)."""
    path = Path(world_root) / "edit_test.jsonl"
    if not path.is_file():
        raise UserError(f"--own-edits needs a ShapesWorld root with edit_test.jsonl; {path} does not exist (--world)")
    return read_edits(path)[:n]


def _own_edits(model, rows: list[dict], world_root: Path, indices: list[int], batch_size: int,
               image_config: ImageGenerationConfig | None, eps: float, out: Path | None) -> dict[int, dict]:
    from unicon.worlds.shapes import Scene, load_world
    from unicon.worlds.shapes_edit import Edit, edit_matches

    cfg = load_world(world_root).config
    records: dict[int, dict] = {}
    for chunk in preemption.batches(indices, batch_size, "editing: own edits"):
        batch = [rows[i] for i in chunk]
        sources = []
        for r in batch:
            with Image.open(world_root / r["image"]) as im:
                sources.append(im.convert("RGB"))
        edited = model.edit_image(sources, [r["text"] for r in batch], config=image_config)
        values = score_images(model, sources, edited, [r["text"] for r in batch], eps)
        for k, (i, r) in enumerate(zip(chunk, batch)):
            edit = Edit(r["kind"], r["text"], Scene.from_dict(r["source_scene"]), Scene.from_dict(r["target_scene"]))
            rec = {"id": r["id"], "kind": r["kind"], "instruction": r["text"], "source_image": r["image"],
                   "exact_match": bool(edit_matches(edited[k], edit, cfg))}
            rec.update({key: values[key][k] for key in (*COMPONENTS, *VARIANTS)})
            if out is not None:
                rel = Path("own_edits") / f"{r['id']}.png"
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                edited[k].save(out / rel)
                rec["edited_image"] = str(rel)
            records[i] = rec
    return records


def own_edit_summary(records: Sequence[dict]) -> dict[str, Any]:
    """Per kind (and ``all``): n, exact-match rate, mean components, mean and median raw score; and the
    Kendall tau_b of each variant against exact match (1/0) over all own edits."""
    def block(rs):
        means = group_means(rs)
        return {"n": means.pop("n"), "exact_match": float(np.mean([r["exact_match"] for r in rs])), **means}

    kinds = sorted({r["kind"] for r in records})
    summary = {"by_kind": {k: block([r for r in records if r["kind"] == k]) for k in kinds}, "all": block(list(records))}
    summary["kendall_vs_exact_match"] = {
        key: kendall_row([r[key] for r in records if math.isfinite(r[key])],
                         [float(r["exact_match"]) for r in records if math.isfinite(r[key])]) for key in CORRELATED}
    return summary


# ---- files ---------------------------------------------------------------------------------------
def markdown_table(results: dict[str, Any]) -> str:
    crit = results["criteria"]
    lines = ["| | " + " | ".join(crit) + " |", "|---|" + "---|" * len(crit)]
    names = {"score": "EditingScore", "no_cos": "without cos_image", "no_sim_text": "without sim_text",
             "no_rls": "without rls", "cos_image": "cos_image alone", "sim_text": "sim_text alone", "rls": "rls alone",
             "judge": "judge score"}
    for key in results["kendall"]:
        cells = [_cell(results["kendall"][key][c]["tau_b"]) for c in crit]
        lines.append(f"| {names[key]} (tau_b) | " + " | ".join(cells) + " |")
    lines.append("")
    agrees = results.get("agrees_with_paper") or {}
    lines.append(f"n = {results['n']}; raw score, not normalised; direction of the score: "
                 + ", ".join(f"{c}: {d}" + {True: " (agrees with the paper)", False: " (the paper's is the opposite)"}
                             .get(agrees.get(c), "") for c, d in results["score_direction"].items())
                 + "; the paper's results (Tables 2-4) have a higher score with a better rating")
    lines += ["", *pearson_lines(results["pearson"]), "", *table3_lines(results["table3"])]
    return "\n".join(lines) + "\n"


def _cell(v: Any, fmt: str = "+.3f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def pearson_lines(pearson: dict[str, Any]) -> list[str]:
    """Table 2 as markdown: Pearson's r of every pair, the paper's value beside each off-diagonal entry."""
    names = pearson["variables"]
    labels = pearson["labels"]
    lines = ["Table 2: Pearson's r between the metrics (this run; the paper's value in brackets)", "",
             "| | " + " | ".join(labels[v] for v in names) + " |", "|---|" + "---|" * len(names)]
    for i, a in enumerate(names):
        cells = []
        for j, b in enumerate(names):
            paper = pearson["paper"].get(f"{a}/{b}", pearson["paper"].get(f"{b}/{a}"))
            cells.append(_cell(pearson["r"][i][j], "+.2f") + (f" ({paper:+.2f})" if paper is not None else ""))
        lines.append(f"| {labels[a]} | " + " | ".join(cells) + " |")
    n = [pearson["n"][i][j] for i in range(len(names)) for j in range(len(names)) if i != j]
    lines += ["", f"pairwise complete samples per entry: {min(n) if n else 0} to {max(n) if n else 0}; the raw score "
              "(up to 1e10 for an unchanged image) dominates r, Kendall's tau reads ranks only"]
    return lines


def table3_lines(table3: dict[str, Any]) -> list[str]:
    """Table 3 as markdown: Kendall tau_b / tau_c against the Human Score, this run and the paper's."""
    rows, paper, judge = table3["rows"], table3["paper"], table3["judge"]
    lines = [f"Table 3: Kendall tau against the Human Score ({table3['human']})", "",
             "| | tau_b | tau_c | n | paper tau_b | paper tau_c |", "|---|---|---|---|---|---|"]
    label = {"human": "Human Score", "score": "EditingScore",
             "judge": f"judge ({judge['spec']}, {judge.get('sees')})" if judge.get("spec") else "judge"}
    for key in ("human", "score", "judge"):
        t = rows[key] or {}
        lines.append(f"| {label[key]} | {_cell(t.get('tau_b'))} | {_cell(t.get('tau_c'))} | {t.get('n', 0)} | "
                     f"{paper[key]['tau_b']:.3f} | {paper[key]['tau_c']:.3f} |")
    lines.append("")
    if judge.get("spec"):
        lines.append(f"the paper's judge is a GPT-based score; here: {judge['spec']} ({judge.get('sees')}), "
                     f"{judge['failures']} of {judge['judged']} replies unparseable (left out)")
    else:
        lines.append(f"judge not run: {judge['not_run']}")
    return lines


def evaluate_editing(model: UnifiedModel, samples: Sequence[EditSample], out_dir: str | Path | None = None,
                     batch_size: int = BATCH_SIZE, eps: float = EPS, info: dict | None = None,
                     own_edits: int = 0, world_root: str | Path | None = None,
                     image_config: ImageGenerationConfig | None = None, check: bool = True,
                     data_root: Path | None = None, judge=None,
                     judge_spec: str | None = None) -> tuple[dict[str, Any], list[dict]]:
    """Score ``samples`` (and ``own_edits`` of the world's test edits) on every rank / shard / merge;
    ``judge`` (:mod:`.judges`) rates every sample too, ``judge_spec`` names it (a merge, which loads
    none, names the shards' judge). Returns ``(results, records)`` (the gathered per-sample records;
    the same on every rank)."""
    from unicon.evaluation.editing.judges import describe

    judge_spec = judge_spec or getattr(judge, "name", None)
    judge_info = describe(judge_spec) if judge_spec else None
    if not samples:
        raise UserError("EditingScore: no samples to evaluate")
    if check:
        check_model(model)
        if own_edits and not getattr(model, "supports_editing", False):
            raise UserError(f"--own-edits: the {model._backend_name()} backend does not edit images (supports_editing)")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    with eval_mode(model):
        mine = shard_indices(len(samples))
        values = _score_samples(model, samples, mine, batch_size, eps, judge)
        records = {i: sample_record(samples[i], values[i], data_root) for i in owned_indices(len(samples))}
        gathered = list(gather_records(records).values())
        own_records = own_summary = None
        if own_edits:
            rows = own_edit_rows(world_root, own_edits) if world_root is not None else []
            n_rows = len(rows)
            own = _own_edits(model, rows, Path(world_root), shard_indices(n_rows), batch_size, image_config, eps, out) \
                if n_rows else {}
            keep = set(owned_indices(n_rows))
            own_records = list(gather_records({i: r for i, r in own.items() if i in keep}).values())
            own_summary = own_edit_summary(own_records) if own_records else None
    results = summarize(gathered, skipped_counts(samples), judge_info)
    if out is not None and writes_outputs():
        if own_records is not None:
            write_jsonl(out / "own_edits.jsonl", own_records)
        own = {"own_edits": own_summary} if own_summary is not None else {}
        write_results(out, "editing.json", {"results": results, **own, "eps": eps, **(info or {})}, gathered,
                      markdown_table(results))
        plot_results(gathered, results, out)
    if own_summary is not None:
        results["own_edits"] = own_summary
    return results, gathered
