"""Competence is a regression-tested property: the ShapesWorld pretraining recipe with image editing
(``experiment=shapes_pretrain_edit``: ``shapes_pretrain`` plus the world's edit rows at weight 3),
trained from scratch on a freshly built world with a shortened schedule, must learn every task well
above chance.

The run is the real one (``unicon build-data shapes``, ``unicon train experiment=shapes_pretrain_edit``,
``unicon evaluate shapes --tasks vqa caption grounding t2i edit``, as subprocesses with the recipe's
thread settings); only the schedule is shortened: :data:`STEPS` steps of the recipe's 2 x 64 examples
with its optimizer and peak lr (cosine over the shortened run). The recipe itself takes 1,250 steps
(Muon at lr 3e-3). The model it leaves is also the ``pretrained_shapes`` fixture (conftest) of the
tests that need a trained model. ``shapes_pretrain`` (the start of ``make demo``) shares everything
with this recipe but the edit rows.

Length. Without the edit rows the 450-step ``unicon train`` command took 3 min 38 s - 3 min 40 s on a
2-core Cascade Lake (4 min 50 s - 5 min 19 s at 600 steps), so the schedule is 450 steps. On an idle
2-core AMD EPYC, one after the other, the 450-step command took 334 s with the edit rows and 280 s
without (1.19 times; an edit row reads a source image and writes a target image).

Floors. Chance levels on the test split: VQA answers by question-type prior ~0.3 (yes/no, 8 colours,
6 shapes, counts); a box with IoU >= 0.5 by guessing ~0.02; an exact caption, a generated image whose
parsed scene matches its prompt, or an edited image that is exactly its target scene ~0 (a scene is
1-4 objects of 48 kinds in 16 cells); the edit likelihood preferring the target to another edit's
target (``edit_pref/other``) 0.5. Measured after 450 steps (200 per task, the model's default
decoding; VQA, exact caption, localization, generated-image match, edit_pref/other): seed 0 0.555,
0.06, 0.175, 0.12, 0.795; seed 1 0.535, 0.11, 0.50, 0.11, 0.90; seed 2 0.535, 0.07, 0.23, 0.095,
0.85. A run on another CPU rounds differently, and its trajectory is as much a fresh draw as another
seed's, so each floor sits well above chance at about half the *lowest* run for the tasks that
emerge at a seed-dependent step (exact caption, localization, T2I), 0.07 under it for VQA, and
0.15 under it for ``edit_pref/other``. Exact edits are not learned in 450 steps (edit_match
0.005-0.02; the full recipe reaches 0.2), and the likelihood still prefers the unchanged source to
the target (``edit_pref/unchanged`` 0.275-0.32; the full recipe 0.68): the short run learns to keep
the source's scene, not yet to change it, and only the former has a floor. The recipe without edit
rows gave VQA 0.51-0.545, exact caption 0.07-0.12, localization 0.24-0.28 and T2I 0.155-0.165 at
450 steps: the edit rows take a quarter of the examples. Caption and T2I competence are also
asserted by likelihood: the gold caption of an image beats its CocoCon contrast captions
(test_ofa_unified.test_pretrained_model_prefers_gold_over_contrast_captions) and the gold prompt is
the likeliest for generating the image (..._prefers_the_gold_caption_for_generating_the_image).
Full-recipe accuracies: results/README.md.
"""

from __future__ import annotations

import json

import pytest

#: the recipe the fixture trains (configs/experiment/shapes_pretrain_edit.yaml)
RECIPE = "shapes_pretrain_edit"
#: shortened schedule of the recipe (the full one: 1,250 steps, configs/experiment/shapes_pretrain.yaml)
STEPS = 450
#: overrides of the shortened schedule beyond its length: none, it keeps the recipe's batch and rate
SHORT_SCHEDULE: tuple[str, ...] = ()
FLOORS = {"vqa_accuracy": 0.46, "caption_match": 0.03, "loc_iou50": 0.09, "t2i_match": 0.05,
          "edit_pref/other": 0.65}


@pytest.mark.slow
def test_pretraining_recipe_learns_every_task_well_above_chance(pretrained_shapes):
    export, world = pretrained_shapes
    if not (export.parent / "competence.json").is_file():
        pytest.skip("the pretrained model came from $UNICON_PRETRAINED, not from the recipe run here")
    acc = json.loads((export.parent / "competence.json").read_text())["metrics"]
    low = {k: (acc.get(k), floor) for k, floor in FLOORS.items() if not acc.get(k, 0.0) >= floor}
    assert not low, f"tasks below their floor after {STEPS} steps (measured, floor): {low}; all: {acc}"
    assert all(acc[f"{k}_n"] >= 200 for k in FLOORS)
