"""Competence is a regression-tested property: the ShapesWorld pretraining recipe, trained from scratch
on a freshly built world with a shortened schedule, must learn every task well above chance.

The run is the real one (``unicon build-data shapes``, ``unicon train experiment=shapes_pretrain``,
``unicon evaluate shapes``, as subprocesses with the recipe's thread settings); only the schedule is
shortened: :data:`STEPS` steps of 2 x 32 examples at lr 1e-3 (:data:`SHORT_SCHEDULE`), under 4 minutes
on the recipe's two DDP ranks. The recipe itself takes 920 steps of 2 x 64 at lr 1.5e-3 (session 9);
cut to the same time, its large steps are too few for the generation tasks to leave zero (420 steps:
VQA 0.495, localization 0.115, exact caption 0.02, generated-image match 0.055; 350 steps: caption 0,
localization 0.06), while 650 steps of the pre-session-9 batch and rate reach the floors below with a
margin.
The model it leaves is also the ``pretrained_shapes`` fixture (conftest) of the tests that need a trained model.

Floors. Chance levels on the test split: VQA answers by question-type prior ~0.3 (yes/no, 8 colours,
6 shapes, counts); a box with IoU >= 0.5 by guessing ~0.02; an exact caption or a generated image whose
parsed scene matches its prompt ~0 (a scene is 1-4 objects of 48 kinds in 16 cells). Measured after
STEPS steps of the recipe (two DDP ranks x 32 examples, 3 min 46 s; 200 per task): VQA 0.525,
localization 0.175, exact caption 0.04, generated-image match 0.045 with the recipe's seed 0; with
seed 1 0.48, 0.075, 0.01, 0.035 and with seed 2 0.505, 0.14, 0.02, 0.035 (session 10). A run on
another CPU rounds differently, and its trajectory is as much a fresh draw as another seed's, so each
floor sits above chance and below the *lowest* of the three seeds; the generation floors only say
that some outputs are exactly right (one exact caption in 200 clears the caption floor, where the
first pretraining recipe had none). Likelihood competence is asserted too: the gold
caption (test_ofa_unified.test_pretrained_model_prefers_gold_over_contrast_captions) and the gold prompt
of an image (..._prefers_the_gold_caption_for_generating_the_image) beat the CocoCon contrasts well above
chance. Issue 16's targets are not met (results/shapes_consistency.md).
"""

from __future__ import annotations

import json

import pytest

#: shortened schedule of the pretraining recipe (the full one: configs/experiment/shapes_pretrain.yaml)
STEPS = 650
#: the batch and peak rate of the shortened schedule (the recipe's before session 9; see the docstring)
SHORT_SCHEDULE = ("data.batch_size=32", "optim.lr=1e-3")
FLOORS = {"vqa_accuracy": 0.40, "loc_iou50": 0.04, "caption_match": 0.005, "t2i_match": 0.01}


@pytest.mark.slow
def test_pretraining_recipe_learns_every_task_well_above_chance(pretrained_shapes):
    export, world = pretrained_shapes
    if not (export.parent / "competence.json").is_file():
        pytest.skip("the pretrained model came from $UNICON_PRETRAINED, not from the recipe run here")
    acc = json.loads((export.parent / "competence.json").read_text())["metrics"]
    low = {k: (acc.get(k), floor) for k, floor in FLOORS.items() if not acc.get(k, 0.0) >= floor}
    assert not low, f"tasks below their floor after {STEPS} steps (measured, floor): {low}; all: {acc}"
    assert all(acc[f"{k}_n"] >= 200 for k in FLOORS)
