"""ShapesWorld instruction rows: the prompt formats of the evaluation suites, asked about training scenes.

Real unified models are instruction-tuned on the formats their benchmarks use; these rows do the same
for the embedded model. Each row is a mixture row of task ``instruct`` (image + prompt -> short text,
trained through ``UnifiedModel.score_text`` with the prompt as ``answer`` receives it) and lands in
``mixture_train.jsonl`` after the think-then-draw rows. The rows state no new truth about the world:
every target is the world's exact answer to a question it already asks, in the suite's format.

Formats (``qtype``):

* ``mc/<qtype>`` -- a training VQA question (colour, shape, count, "where is A relative to B") as
  RealUnify's Table 8 multiple-choice prompt (:func:`unicon.evaluation.realunify.prompts.multiple_choice_prompt`)
  with the world's answer and three other answers of the same type; target: the answer's letter.
* ``geu/<category>`` -- RealUnify's GEU items (:func:`unicon.worlds.shapes_realunify.geu_items`) drawn
  from training scenes, in Table 8; target: the letter the world verifies. Their images are written to
  ``images/instruct/``.
* ``rating`` -- BagelScore's prompt (:func:`unicon.evaluation.alignment.prompts.bagelscore_prompt`) about a
  training image and a caption with 0-3 controlled errors (:func:`unicon.worlds.shapes_alignment.make_pair`);
  target: the prompt's value nearest to the share of true statements (1.0 only when all are true).

No row names a held-out composition, in its text or in its image. Row ``i`` of each format uses the RNG
``(seed, INSTRUCT_STREAM, format, i)``: nothing else in the world depends on these rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from unicon.evaluation.alignment.prompts import ANSWERS, VALUES, bagelscore_prompt
from unicon.evaluation.realunify.prompts import LETTERS, multiple_choice_prompt
from unicon.worlds.shapes import RELATIONS, Scene, WorldConfig, render
from unicon.worlds.shapes_alignment import make_pair
from unicon.worlds.shapes_realunify import geu_items
from unicon.worlds.shapes_text import NUMBER_WORDS, mentions_kind

#: the RNG stream of the instruction rows (beside the builder's 11..23, 41, 43 and alignment's 53)
INSTRUCT_STREAM = 61
TASK = "instruct"
#: VQA question types asked as multiple choice (yes/no questions have two options, not four)
MC_QTYPES = ("color", "shape", "count", "relation")


def rating_answer(share: float) -> str:
    """The BagelScore value for a caption whose statements are true in share ``share``: ``1.0`` only when
    all are true, otherwise the nearest of 0 / 0.3 / 0.6 (ties to the higher)."""
    if share >= 1.0:
        return ANSWERS[-1]
    k = min(range(3), key=lambda i: (abs(VALUES[i] - share), -i))
    return ANSWERS[k]


def _mc_options(qtype: str, answer: str, cfg: WorldConfig, rng: np.random.Generator) -> list[str] | None:
    if qtype == "color":
        pool = [c for c in cfg.color_names if c != answer]
    elif qtype == "shape":
        pool = [s for s in cfg.shapes if s != answer]
    elif qtype == "count":
        n = NUMBER_WORDS.index(answer)
        pool = [w for w in NUMBER_WORDS[: cfg.grid * cfg.grid + 1] if w != answer]
        pool.sort(key=lambda w: abs(NUMBER_WORDS.index(w) - n))
        pool = pool[:6]
    elif qtype == "relation" and answer in RELATIONS:
        pool = [r for r in RELATIONS if r != answer]
    else:
        return None
    if len(pool) < 3:
        return None
    return [pool[i] for i in rng.choice(len(pool), size=3, replace=False)]


def _row(rid: str, image: str, text: str, target: str, qtype: str, scene: dict) -> dict[str, Any]:
    return {"id": rid, "scene_id": None, "image": image, "task": TASK, "text": text, "target": target,
            "qtype": qtype, "scene": scene}


def mc_rows(vqa_rows: Sequence[dict[str, Any]], cfg: WorldConfig, seed: int, n: int) -> Iterator[dict[str, Any]]:
    """Up to ``n`` Table 8 rows from VQA rows (every k-th eligible one), the answer's letter balanced."""
    eligible = [r for r in vqa_rows if r.get("qtype") in MC_QTYPES and
                (r["qtype"] != "relation" or r["target"] in RELATIONS)]
    step = max(1, len(eligible) // max(n, 1))
    for i, r in enumerate(eligible[::step][:n]):
        rng = np.random.default_rng([seed, INSTRUCT_STREAM, 0, i])
        distractors = _mc_options(r["qtype"], r["target"], cfg, rng)
        if distractors is None:
            continue
        pos = i % 4
        options = list(distractors)
        options.insert(pos, r["target"])
        yield _row(f"train-instruct-mc-{i}", r["image"], multiple_choice_prompt(r["text"], options), LETTERS[pos],
                   f"mc/{r['qtype']}", r["scene"])


def geu_rows(scenes: Sequence[Scene], cfg: WorldConfig, seed: int, per_category: int, out: Path,
             held_out: Sequence[tuple[str, str]]) -> Iterator[dict[str, Any]]:
    """GEU items over training scenes, in Table 8, their images rendered to ``images/instruct/``."""
    (out / "images" / "instruct").mkdir(parents=True, exist_ok=True)
    for k, (row, scene) in enumerate(geu_items(cfg, scenes, per_category, seed + INSTRUCT_STREAM)):
        text = multiple_choice_prompt(row["question"], row["options"])
        if held_out and (mentions_kind(text, held_out) or any(o.kind in held_out for o in scene)):
            continue
        rel = f"images/instruct/{row['id']}.png"
        img_seed = int(np.random.SeedSequence([seed, INSTRUCT_STREAM, 1, k]).generate_state(1)[0])
        render(scene, cfg, seed=img_seed).save(out / rel)
        yield _row(f"train-instruct-{row['id']}", rel, text, row["answer"], f"geu/{row['category']}", scene.to_dict())


def rating_rows(images: Sequence[tuple[str, Scene]], cfg: WorldConfig, seed: int, n: int,
                held_out: Sequence[tuple[str, str]]) -> Iterator[dict[str, Any]]:
    """BagelScore rows: pair ``i`` over image ``i mod len(images)``, its caption's errors controlled."""
    for i in range(n):
        image, scene = images[i % len(images)]
        pair = make_pair(scene, cfg, np.random.default_rng([seed, INSTRUCT_STREAM, 2, i]))
        if held_out and mentions_kind(pair["caption"], held_out):
            continue
        yield _row(f"train-instruct-rating-{i}", image, bagelscore_prompt(pair["caption"]),
                   rating_answer(pair["share"]), "rating", scene.to_dict())


def instruct_rows(train_rows: Sequence[dict[str, Any]], cfg: WorldConfig, seed: int, out: Path,
                  held_out: Sequence[tuple[str, str]], mc: int, geu_per_category: int,
                  ratings: int) -> Iterator[dict[str, Any]]:
    """Every instruction row of a world whose training mixture rows are ``train_rows``."""
    images: dict[str, Scene] = {}
    for r in train_rows:
        if r["task"] in ("caption", "vqa", "grounding") and r["image"] not in images:
            images[r["image"]] = Scene.from_dict(r["scene"])
    yield from mc_rows([r for r in train_rows if r["task"] == "vqa"], cfg, seed, mc)
    yield from geu_rows(list(images.values()), cfg, seed, geu_per_category, out, held_out)
    yield from rating_rows(list(images.items()), cfg, seed, ratings, held_out)


__all__ = ["INSTRUCT_STREAM", "TASK", "instruct_rows", "rating_answer", "mc_rows", "geu_rows",
           "rating_rows"]
