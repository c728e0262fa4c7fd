"""Creating a study: balanced assignment of samples to annotators, masked orders, tokens.

A *sample* is one seed; its page holds two items, the understanding item (input image and each
model's first caption) and the generation item (input prompt and each model's first image), and both
go to the same annotators. :func:`balanced_assignment` gives every sample ``overlap`` distinct
annotators and every annotator ``floor`` or ``ceil`` of ``samples * overlap / annotators`` samples
(workloads differ by at most one sample, i.e. two items). The output order of every (annotator,
sample, section) is drawn at random and stored in the database, which is the only place that knows
which letter is which model.
"""

from __future__ import annotations

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


def balanced_assignment(n_samples: int, annotators: int, overlap: int, seed: int) -> list[list[int]]:
    """``result[s]``: the ``overlap`` distinct annotator indices of sample ``s``.

    Slots ``s * overlap + j`` are dealt round-robin over a shuffled annotator order, after the
    samples are shuffled: consecutive slots of one sample are distinct because ``overlap <=
    annotators``, and round-robin dealing makes the counts differ by at most one.
    """
    if overlap < 1:
        raise UserError(f"--overlap must be >= 1, got {overlap}")
    if annotators < overlap:
        raise UserError(f"--overlap {overlap} needs at least {overlap} annotators, got {annotators}")
    rng = random.Random(seed)
    people = list(range(annotators))
    rng.shuffle(people)
    samples = list(range(n_samples))
    rng.shuffle(samples)
    result: list[list[int]] = [[] for _ in range(n_samples)]
    slot = 0
    for s in samples:
        for _ in range(overlap):
            result[s].append(people[slot % annotators])
            slot += 1
    return result


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
