"""Competence is a regression-tested property: the ShapesWorld pretraining recipe, trained from scratch
on a freshly built world with a shortened schedule, must learn every task well above chance.

The run is the real one (``unicon build-data shapes``, ``unicon train experiment=shapes_pretrain``,
``unicon evaluate shapes``, as subprocesses with the recipe's thread settings); only the schedule is
shortened: :data:`STEPS` steps of the recipe's 2 x 64 examples with its optimizer and peak lr (cosine
over the shortened run), 4-5 minutes on the recipe's two DDP ranks. The recipe itself takes 1,250
steps (session 11; Muon at lr 3e-3 since session 14). With the 2+2-layer preset the previous short schedule (650 steps of 2 x 32 at lr 1e-3,
3 min 12 s) left seed 0 at VQA 0.485, localization 0.085, exact caption 0 and generated-image match
0.02: no exact caption, under the caption floor.
The model it leaves is also the ``pretrained_shapes`` fixture (conftest) of the tests that need a trained model.

Floors. Chance levels on the test split: VQA answers by question-type prior ~0.3 (yes/no, 8 colours,
6 shapes, counts); a box with IoU >= 0.5 by guessing ~0.02; a generated image whose parsed scene
matches its prompt ~0 (a scene is 1-4 objects of 48 kinds in 16 cells). Measured after STEPS steps
(200 per task; VQA, localization, exact caption, generated-image match; session 11): seed 0 0.47,
0.18, 0.01, 0.09; seed 1 0.48, 0.12, 0, 0.065; seed 2 0.575, 0.28, 0.13, 0.04. A run on another CPU
rounds differently, and its trajectory is as much a fresh draw as another seed's, so each floor sits
above chance and below the *lowest* of the seeds (these were measured with AdamW; session 14's Muon
learns more per step, every task gaining on every seed at 1,250 steps, and CI's seed-0 run gave
0.60, 0.29, 0.13, 0.25 after STEPS steps; the floors stay as the conservative ones until Muon's
seeds 1 and 2 are measured here). The exact caption has no floor here: with the 2+2 preset it emerges
around this schedule (0, 0.01 and 0.13 at 600 steps; 42-52% at the recipe's 1,250), so one seed in
three would fail any floor above zero. Caption competence is asserted by likelihood instead, as T2I's
is too: the gold caption of an image beats its CocoCon contrast captions
(test_ofa_unified.test_pretrained_model_prefers_gold_over_contrast_captions; 0.49-0.53 at 600 steps
with seeds 0 and 1, against a chance of 0.26) and the gold prompt is the likeliest for generating the image
(..._prefers_the_gold_caption_for_generating_the_image; 0.67-0.68). Issue 16's targets are not met
(results/shapes_consistency.md).
"""

from __future__ import annotations

import json

import pytest

#: shortened schedule of the pretraining recipe (the full one: configs/experiment/shapes_pretrain.yaml)
STEPS = 600
#: overrides of the shortened schedule beyond its length: none, it keeps the recipe's batch and rate
SHORT_SCHEDULE: tuple[str, ...] = ()
FLOORS = {"vqa_accuracy": 0.40, "loc_iou50": 0.04, "t2i_match": 0.01}


@pytest.mark.slow
def test_pretraining_recipe_learns_every_task_well_above_chance(pretrained_shapes):
    export, world = pretrained_shapes
    if not (export.parent / "competence.json").is_file():
        pytest.skip("the pretrained model came from $UNICON_PRETRAINED, not from the recipe run here")
    acc = json.loads((export.parent / "competence.json").read_text())["metrics"]
    low = {k: (acc.get(k), floor) for k, floor in FLOORS.items() if not acc.get(k, 0.0) >= floor}
    assert not low, f"tasks below their floor after {STEPS} steps (measured, floor): {low}; all: {acc}"
    assert all(acc[f"{k}_n"] >= 200 for k in FLOORS)
