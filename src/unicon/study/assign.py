"""Creating a study: balanced assignment of samples to annotators, masked orders, tokens.

A *sample* is one seed; its page holds two items, the understanding item (input image and each
model's first caption) and the generation item (input prompt and each model's first image), and both
go to the same annotators (one annotator rates a model's caption and its image of the same pair,
which the consistency of paper Fig. 9 compares; the paper's pages hold both sections too). The unit
of work is therefore the item, and every page holds exactly two of them: :func:`balanced_assignment`
gives every sample ``overlap`` distinct annotators and every annotator ``floor`` or ``ceil`` of
``samples * overlap / annotators`` pages, i.e. item workloads that differ by at most the two items of
one page (equal whenever ``samples * overlap`` is a multiple of the annotators), and it **rotates the
groups of annotators**: the pairs of annotators share samples as evenly as the search finds (with
overlap 2, 3 to 8 annotators and at least ``C(annotators, 2)`` samples, every pair shares a sample and
the pairs' counts differ by at most one), so agreement rests on many pairings, not on a few fixed
ones. ``study.json`` lists each annotator's pages and items. The output order of every (annotator,
sample, section) is drawn at random and stored in the database, which is the only place that knows
which letter is which model.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path
from typing import Sequence

import sqlalchemy as sa

from unicon.errors import UserError
from unicon.study import db
from unicon.study.inputs import ModelRun


#: restarts of the randomised greedy assignment; the most even pair coverage is kept
ASSIGNMENT_RESTARTS = 64


def _greedy_plan(n_samples: int, annotators: int, overlap: int, rng: random.Random) -> list[list[int]]:
    """One randomised greedy plan: each sample takes, one at a time, an annotator of the lowest load
    (so loads stay within one page of each other), among those the one who has shared the fewest
    samples with the annotators already chosen (then the fewest with anyone, then at random)."""
    load = [0] * annotators
    together = [[0] * annotators for _ in range(annotators)]
    plan: list[list[int]] = []
    for _ in range(n_samples):
        group: list[int] = []
        for _ in range(overlap):
            free = [p for p in range(annotators) if p not in group]
            low = min(load[p] for p in free)
            free = [p for p in free if load[p] == low]
            key = {p: (max((together[p][q] for q in group), default=0), sum(together[p][q] for q in group),
                       rng.random()) for p in free}
            group.append(min(free, key=key.__getitem__))
        for p in group:
            load[p] += 1
            for q in group:
                if q != p:
                    together[p][q] += 1
        plan.append(sorted(group))
    return plan


def pair_counts(plan: list[list[int]], annotators: int) -> dict[tuple[int, int], int]:
    """``{(a, b): samples a and b both annotate}`` over every pair ``a < b`` of annotators."""
    counts = {pair: 0 for pair in itertools.combinations(range(annotators), 2)}
    for group in plan:
        for pair in itertools.combinations(sorted(group), 2):
            counts[pair] += 1
    return counts


def balanced_assignment(n_samples: int, annotators: int, overlap: int, seed: int) -> list[list[int]]:
    """``result[s]``: the ``overlap`` distinct annotator indices of sample ``s``.

    Loads (pages per annotator) differ by at most one; among :data:`ASSIGNMENT_RESTARTS` randomised
    greedy plans (:func:`_greedy_plan`, seeded by ``seed``) the one whose pairs of annotators share
    samples most evenly is kept (smallest max - min of :func:`pair_counts`, then the most pairs that
    share a sample), and the samples are then shuffled, so which sample gets which group is random too.
    """
    if overlap < 1:
        raise UserError(f"--overlap must be >= 1, got {overlap}")
    if annotators < overlap:
        raise UserError(f"--overlap {overlap} needs at least {overlap} annotators, got {annotators}")
    rng = random.Random(seed)
    best, best_key = None, None
    for _ in range(ASSIGNMENT_RESTARTS if overlap >= 2 else 1):
        plan = _greedy_plan(n_samples, annotators, overlap, rng)
        counts = list(pair_counts(plan, annotators).values()) or [0]
        key = (max(counts) - min(counts), -sum(c > 0 for c in counts))
        if best_key is None or key < best_key:
            best, best_key = plan, key
    assert best is not None
    rng.shuffle(best)
    return best


def annotator_names(spec: str) -> list[str]:
    """``"6"`` -> annotator-1..annotator-6; ``"ann,bob"`` -> those names."""
    spec = spec.strip()
    if spec.isdigit():
        n = int(spec)
        if n < 1:
            raise UserError(f"--annotators must be a positive count or a comma list of names, got {spec!r}")
        return [f"annotator-{i}" for i in range(1, n + 1)]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UserError(f"--annotators must be a positive count or a comma list of names, got {spec!r}")
    if len(set(names)) != len(names):
        raise UserError(f"--annotators lists a name twice: {spec!r}")
    return names


def write_tokens_file(path: Path, links: dict[str, str]) -> None:
    """``name<TAB>link`` lines, created with mode 0600 (never readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        for name, link in links.items():
            f.write(f"{name}\t{link}\n")
    os.chmod(path, 0o600)


def create_study(engine: sa.Engine, runs: Sequence[ModelRun], ids: Sequence[str], names: Sequence[str], *,
                 overlap: int = 2, seed: int = 0) -> dict[str, str]:
    """Write the study into an empty database; returns ``{annotator name: token}`` (shown once)."""
    if db.has_study(engine):
        raise UserError(f"{engine.url}: already holds a study; use another --out / --db")
    plan = balanced_assignment(len(ids), len(names), overlap, seed)
    rng = random.Random(seed + 1)
    tokens = {name: db.new_token() for name in names}
    with engine.begin() as conn:  # the rows in one transaction: a failed create leaves no half study
        db.metadata.create_all(conn)
        settings = {"overlap": overlap, "seed": seed, "created": time.time(), "models": [r.name for r in runs],
                    "samples": len(ids), "annotators": list(names)}
        conn.execute(sa.insert(db.meta_t), [{"key": k, "value": json.dumps(v)} for k, v in settings.items()])
        model_ids = {}
        for r in runs:
            model_ids[r.name] = conn.execute(sa.insert(db.models_t).values(
                name=r.name, source=str(r.source), metrics=json.dumps(r.metrics))).inserted_primary_key[0]
        person_ids = [conn.execute(sa.insert(db.annotators_t).values(
            name=n, token_hash=db.hash_token(tokens[n]))).inserted_primary_key[0] for n in names]
        sample_ids, outputs = [], []
        for i in ids:
            sid = conn.execute(sa.insert(db.samples_t).values(
                seed_id=i, prompt=runs[0].prompts[i], input_png=runs[0].inputs[i])).inserted_primary_key[0]
            sample_ids.append(sid)
            per = {}
            for section in db.SECTIONS:
                per[section] = [conn.execute(sa.insert(db.outputs_t).values(
                    sample_id=sid, section=section, model_id=model_ids[r.name],
                    caption=r.captions[i] if section == "understanding" else None,
                    image_png=r.images[i] if section == "generation" else None)).inserted_primary_key[0]
                    for r in runs]
            outputs.append(per)
        queues: dict[int, list[int]] = {p: [] for p in range(len(names))}
        for s, people in enumerate(plan):
            for p in people:
                queues[p].append(s)
        rows = []
        for p, samples in queues.items():
            rng.shuffle(samples)
            for pos, s in enumerate(samples):
                order = {}
                for section in db.SECTIONS:
                    ids_ = list(outputs[s][section])
                    rng.shuffle(ids_)
                    order[section] = ids_
                rows.append({"annotator_id": person_ids[p], "sample_id": sample_ids[s], "position": pos,
                             "order_json": json.dumps(order)})
        if rows:
            conn.execute(sa.insert(db.assignments_t), rows)
    return tokens
