"""Competence is a regression-tested property: the ShapesWorld pretraining recipe, trained from scratch
on a freshly built world with a shortened schedule, must learn every task well above chance.

The run is the real one (``unicon build-data shapes``, ``unicon train experiment=shapes_pretrain``,
``unicon evaluate shapes``, as subprocesses with the recipe's thread settings); only the schedule is
shortened: :data:`STEPS` steps of the recipe's 2 x 64 examples with its optimizer and peak lr (cosine
over the shortened run), 4-5 minutes on the recipe's two DDP ranks. The recipe itself takes 1,250
steps (session 11; Muon at lr 3e-3 since session 14).
The model it leaves is also the ``pretrained_shapes`` fixture (conftest) of the tests that need a trained model.

Floors. Chance levels on the test split: VQA answers by question-type prior ~0.3 (yes/no, 8 colours,
6 shapes, counts); a box with IoU >= 0.5 by guessing ~0.02; an exact caption or a generated image
whose parsed scene matches its prompt ~0 (a scene is 1-4 objects of 48 kinds in 16 cells).
Measured after STEPS steps with the recipe's Muon (session 15, 200 per task; VQA, exact caption,
localization, generated-image match): seed 0 0.555, 0.13, 0.36, 0.205; seed 1 0.52, 0.28, 0.915,
0.21; seed 2 0.595, 0.14, 0.575, 0.17 (session 14's CI run, another CPU: 0.60, 0.13, 0.29, 0.25).
A run on another CPU rounds differently, and its trajectory is as much a fresh draw as another
seed's, so each floor sits well above chance and at about half the *lowest* run for the tasks that
emerge at a seed-dependent step (localization 0.29-0.92, exact caption 0.13-0.28, T2I 0.17-0.25),
and 0.07 under it for VQA, steady at 0.47-0.60 over the seven runs of both optimizers. With session 11's AdamW
the same schedule gave 0.47-0.575 VQA, 0-0.13 exact captions, 0.12-0.28 localization and 0.04-0.09
T2I, and the exact caption had no floor. Caption and T2I competence are also asserted by likelihood:
the gold caption of an image beats its CocoCon contrast captions
(test_ofa_unified.test_pretrained_model_prefers_gold_over_contrast_captions) and the gold prompt is
the likeliest for generating the image (..._prefers_the_gold_caption_for_generating_the_image).
The floors were measured with session 15's decoding (3 beams, images at temperature 1); since
session 16 the model captions with 5 beams and samples images with top-p 0.9, which raised the
exact caption and T2I of the same weights (results/shapes_consistency.md, "Session 16"), so the
floors hold with more margin. Issue 16's targets are not all met (results/shapes_consistency.md).
"""

from __future__ import annotations

import json

import pytest

#: shortened schedule of the pretraining recipe (the full one: configs/experiment/shapes_pretrain.yaml)
STEPS = 600
#: overrides of the shortened schedule beyond its length: none, it keeps the recipe's batch and rate
SHORT_SCHEDULE: tuple[str, ...] = ()
FLOORS = {"vqa_accuracy": 0.45, "caption_match": 0.05, "loc_iou50": 0.15, "t2i_match": 0.08}


@pytest.mark.slow
def test_pretraining_recipe_learns_every_task_well_above_chance(pretrained_shapes):
    export, world = pretrained_shapes
    if not (export.parent / "competence.json").is_file():
        pytest.skip("the pretrained model came from $UNICON_PRETRAINED, not from the recipe run here")
    acc = json.loads((export.parent / "competence.json").read_text())["metrics"]
    low = {k: (acc.get(k), floor) for k, floor in FLOORS.items() if not acc.get(k, 0.0) >= floor}
    assert not low, f"tasks below their floor after {STEPS} steps (measured, floor): {low}; all: {acc}"
    assert all(acc[f"{k}_n"] >= 200 for k in FLOORS)
