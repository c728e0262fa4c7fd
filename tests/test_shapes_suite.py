"""The ShapesWorld task-accuracy suite: each metric of ``evaluation/shapes/metrics.py`` against a hand
computation, their states synced over 2 gloo ranks == one process over all the data, the runner
sharded over 2 gloo ranks == one process, and the epoch-end callback logging ``shapes/<task>/<key>``
in a short training run (and ``unicon evaluate all`` running the same settings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import standins
from unicon.evaluation.shapes.metrics import (CaptionMatch, EditMatch, EditPreference, LocalizationAccuracy,
                                              RelationFlip, T2IMatch, VQAAccuracy, logged_scalars, report)
from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, render
from unicon.worlds.shapes_text import describe_scene

EPS64 = torch.finfo(torch.float64).eps
CFG = WorldConfig()  # the default world: red, green, blue, ... circles, squares, ...
ONE = Scene((ShapeObject("circle", "red", 0, 0),))
TWO = Scene((ShapeObject("circle", "red", 0, 0), ShapeObject("square", "blue", 0, 2)))
RECOLOURED = Scene((ShapeObject("circle", "green", 0, 0), ShapeObject("square", "blue", 0, 2)))
MAGENTA = (255, 0, 255)  # not a colour of the world: the parser refuses the image


def _cases() -> dict[str, tuple]:
    """Hand-made ``update`` arguments per metric (five examples each)."""
    return {
        # normalised: "circle" = circle, "2" = two, red != blue, yes = yes, no != yes
        "vqa": (["The circle.", "2", "red", "yes", "no"], ["circle", "two", "blue", "yes", "yes"],
                [["shape"], ["count", "count_all"], ["color"], ["exist", "held_out"], ["exist"]]),
        # right; not English; one object short; a colour wrong; right
        "caption": ([describe_scene(TWO), "a zebra", describe_scene(ONE), describe_scene(RECOLOURED),
                     describe_scene(ONE)], [TWO, TWO, TWO, TWO, ONE],
                    [["objects_2"], ["objects_2"], ["objects_2"], ["objects_2"], ["objects_1"]]),
        # IoU 1, 50/150, 50/100 (counts: >= 0.5), 0 (an inverted box is empty), 0 (disjoint)
        "grounding": ([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, -1, 4], [20, 20, 5, 5]],
                      [[0, 0, 10, 10], [5, 0, 10, 10], [0, 0, 10, 5], [0, 0, 2, 2], [0, 0, 5, 5]],
                      [["held_out"], ["no_held_out"], ["no_held_out"], ["no_held_out"], ["held_out"]]),
        # right; draws one object short; one too many; not an image of the world; a colour wrong
        "t2i": ([render(TWO, CFG), render(ONE, CFG), render(TWO, CFG), Image.new("RGB", (64, 64), MAGENTA),
                 render(RECOLOURED, CFG)],
                [describe_scene(TWO), describe_scene(TWO), describe_scene(ONE), describe_scene(TWO),
                 describe_scene(TWO)],
                [["no_relation"]] * 5),
        # (answer, gold, flipped answer, flipped gold): read the word; kept it; read it ("No." = no);
        # kept it, wrong both times; read it, wrong both times
        "flip": (["yes", "yes", "No.", "no", "no"], ["yes", "yes", "no", "yes", "yes"],
                 ["no", "yes", "yes", "no", "yes"], ["no", "no", "yes", "no", "no"]),
    }


def _metrics(**kwargs) -> dict:
    slices = {task: {name for names in case[2] for name in names} for task, case in _cases().items() if task != "flip"}
    return {"vqa": VQAAccuracy(slices["vqa"], **kwargs), "caption": CaptionMatch(slices["caption"], CFG, **kwargs),
            "grounding": LocalizationAccuracy(slices["grounding"], **kwargs),
            "t2i": T2IMatch(slices["t2i"], CFG, **kwargs), "flip": RelationFlip(**kwargs)}


def _update(metrics: dict, keep) -> None:
    """Each metric updated with the examples ``keep(i)`` of its case."""
    for task, case in _cases().items():
        metrics[task].update(*([x for i, x in enumerate(part) if keep(i)] for part in case))


def _one_process() -> dict:
    metrics = _metrics()
    _update(metrics, lambda i: True)
    return {task: m.compute() for task, m in metrics.items()}


# ---------------------------------------------------------------------------------------------
# each metric against a hand computation
# ---------------------------------------------------------------------------------------------
def test_vqa_accuracy_by_hand():
    assert _one_process()["vqa"] == {
        "vqa_accuracy": 3 / 5, "vqa_accuracy_n": 5.0,
        "vqa_accuracy/color": 0 / 1, "vqa_accuracy/color_n": 1.0,
        "vqa_accuracy/count": 1 / 1, "vqa_accuracy/count_n": 1.0,
        "vqa_accuracy/count_all": 1 / 1, "vqa_accuracy/count_all_n": 1.0,
        "vqa_accuracy/exist": 1 / 2, "vqa_accuracy/exist_n": 2.0,
        "vqa_accuracy/held_out": 1 / 1, "vqa_accuracy/held_out_n": 1.0,
        "vqa_accuracy/shape": 1 / 1, "vqa_accuracy/shape_n": 1.0,
    }


def test_caption_match_and_its_miss_causes_by_hand():
    got = _one_process()["caption"]
    assert got == {
        "caption_match": 2 / 5, "caption_match_n": 5.0,
        "caption_match/objects_1": 1 / 1, "caption_match/objects_1_n": 1.0,
        "caption_match/objects_2": 1 / 4, "caption_match/objects_2_n": 4.0,
        "caption_error/unparsable": 1 / 5, "caption_error/fewer_objects": 1 / 5, "caption_error/more_objects": 0 / 5,
        "caption_error/attributes": 1 / 5, "caption_error/relation": 0 / 5,
    }
    # the accuracy and the miss causes partition the examples
    assert got["caption_match"] + sum(v for k, v in got.items() if "_error/" in k) == pytest.approx(1.0, abs=5 * EPS64)


def test_localization_accuracy_and_mean_iou_by_hand():
    got = _one_process()["grounding"]
    miou = got.pop("loc_miou")
    assert got == {"loc_iou50": 2 / 5, "loc_iou50_n": 5.0,
                   "loc_iou50/held_out": 1 / 2, "loc_iou50/held_out_n": 2.0,
                   "loc_iou50/no_held_out": 1 / 3, "loc_iou50/no_held_out_n": 3.0}
    # (1 + 1/3 + 1/2 + 0 + 0) / 5, each IoU and the sum rounded in float64
    assert miou == pytest.approx((1 + 1 / 3 + 1 / 2) / 5, rel=5 * EPS64)


def test_t2i_match_and_its_miss_causes_by_hand():
    got = _one_process()["t2i"]
    assert got == {
        "t2i_match": 1 / 5, "t2i_match_n": 5.0,
        "t2i_match/no_relation": 1 / 5, "t2i_match/no_relation_n": 5.0,
        "t2i_error/not_an_image": 1 / 5, "t2i_error/fewer_objects": 1 / 5, "t2i_error/more_objects": 1 / 5,
        "t2i_error/attributes": 1 / 5, "t2i_error/relation": 0 / 5,
    }


def test_relation_flip_by_hand():
    # kept: 2nd, 4th -> 2/5; both right: 1st, 3rd -> 2/5
    assert _one_process()["flip"] == {"vqa_relation_flip/answer_kept": 2 / 5, "vqa_relation_flip/both_right": 2 / 5,
                                      "vqa_relation_flip/answer_kept_n": 5.0}


def test_edit_match_and_its_miss_causes_by_hand():
    """Edits recolour the circle of TWO (-> RECOLOURED): right; left as it was; another scene; not an
    image of the world; right. Slices are the edit kinds."""
    metric = EditMatch(["recolor", "remove"], CFG)
    pair = (TWO, RECOLOURED)
    metric.update([render(RECOLOURED, CFG), render(TWO, CFG), render(ONE, CFG),
                   Image.new("RGB", (64, 64), MAGENTA), render(ONE, CFG)],
                  [pair, pair, pair, pair, (TWO, ONE)],
                  [["recolor"], ["recolor"], ["recolor"], ["recolor"], ["remove"]])
    assert metric.compute() == {
        "edit_match": 2 / 5, "edit_match_n": 5.0,
        "edit_match/recolor": 1 / 4, "edit_match/recolor_n": 4.0,
        "edit_match/remove": 1 / 1, "edit_match/remove_n": 1.0,
        "edit_error/not_an_image": 1 / 5, "edit_error/unchanged": 1 / 5, "edit_error/wrong_scene": 1 / 5,
    }
    assert logged_scalars({"edit_match": 0.4})["shapes/edit/edit_match"] == 0.4


def test_the_edit_task_is_refused_for_a_model_that_does_not_edit(tiny_shapes_world):
    from unicon.errors import UserError
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    model = _fake_model(tiny_shapes_world)
    model.supports_editing = False
    with pytest.raises(UserError, match="task edit needs a model that edits images; the .* backend"):
        shapes_task_accuracies(model, tiny_shapes_world, "test", limit=2, tasks=["edit"])


def test_the_runner_reads_the_worlds_edit_rows_and_counts_them_by_kind(tiny_shapes_world):
    """The stand-in's identity edit leaves every source as it was: every edit row is a miss of cause
    ``unchanged`` (no kind's target equals its source), sliced by the rows' kinds."""
    from unicon.data.mixture import read_edits
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    rows = read_edits(tiny_shapes_world / "edit_test.jsonl")
    got = shapes_task_accuracies(_fake_model(tiny_shapes_world), tiny_shapes_world, "test", limit=None, tasks=["edit"])
    assert got["edit_match"] == 0.0 and got["edit_match_n"] == len(rows) > 0
    assert got["edit_error/unchanged"] == 1.0
    kinds = {r["kind"] for r in rows}
    assert {k.split("/")[1] for k in got if k.startswith("edit_match/") and not k.endswith("_n")} == kinds
    assert sum(got[f"edit_match/{k}_n"] for k in kinds) == len(rows)
    # the identity editor's likelihood (standins.pixel_distance) prefers the unchanged source to every
    # target, and each source's own target to the next row's when its pixels are closer
    assert got["edit_pref/unchanged"] == 0.0 and got["edit_pref/unchanged_n"] == len(rows)

    def pixels(path):
        with Image.open(tiny_shapes_world / path) as im:
            return im.convert("RGB")

    closer = [standins.pixel_distance(pixels(r["image"]), pixels(r["target_image"]))
              < standins.pixel_distance(pixels(r["image"]), pixels(rows[(i + 1) % len(rows)]["target_image"]))
              for i, r in enumerate(rows)]
    assert got["edit_pref/other"] == pytest.approx(sum(closer) / len(rows)) and got["edit_pref/other_n"] == len(rows)


def test_the_runner_stops_at_the_next_batch_when_preempted(tiny_shapes_world, monkeypatch):
    """A watched SIGTERM/SIGUSR1 stops the task loop before its next batch (Preempted), as in every
    other suite's runner: a standalone ``unicon evaluate shapes`` no longer runs to its end."""
    import signal

    from unicon.evaluation import preemption
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    model = _fake_model(tiny_shapes_world)
    calls = []
    answer = model.answer
    monkeypatch.setattr(model, "answer", lambda *a, **k: calls.append(1) or answer(*a, **k), raising=False)
    monkeypatch.setattr(preemption, "_received", [signal.SIGTERM])
    with pytest.raises(preemption.Preempted):
        shapes_task_accuracies(model, tiny_shapes_world, "test", limit=4, batch_size=2, tasks=["vqa"])
    assert calls == []


def test_edit_preference_by_hand():
    m = EditPreference()
    m.update([1.0, 5.0, 2.0], [2.0, 4.0, 2.0], [3.0, None, 1.0])  # ties count as misses
    assert m.compute() == {"edit_pref/unchanged": 1 / 3, "edit_pref/unchanged_n": 3.0,
                           "edit_pref/other": 1 / 2, "edit_pref/other_n": 2.0}


def test_no_example_reports_nothing_and_an_unknown_slice_is_an_error():
    for metric in (VQAAccuracy(["shape"]), LocalizationAccuracy(), RelationFlip()):
        with pytest.warns(UserWarning, match="before the ``update``"):  # torchmetrics' own warning
            assert metric.compute() == {}
    with pytest.raises(ValueError, match="slice 'colour'"):
        VQAAccuracy(["shape"]).update(["red"], ["red"], [["colour"]])
    with pytest.raises(ValueError, match="2 predictions, 1 targets"):
        VQAAccuracy().update(["red", "blue"], ["red"], [[], []])


def test_report_order_and_logged_names():
    """The report's order: accuracies task by task, then caption and T2I misses, relation flips, mean IoU;
    the loggers get shapes/<task>/<key>."""
    one = _one_process()
    out = report([one["vqa"], one["flip"], one["caption"], one["grounding"], one["t2i"]])
    keys = list(out)
    groups = [[k for k in keys if k.startswith(p)] for p in
              ("vqa_accuracy", "caption_match", "loc_iou50", "t2i_match", "caption_error/", "t2i_error/",
               "vqa_relation_flip/", "loc_miou")]
    assert keys == [k for group in groups for k in group]
    assert keys[:2] == ["vqa_accuracy", "vqa_accuracy_n"] and keys[-1] == "loc_miou"
    logged = logged_scalars(out)
    assert list(logged.values()) == list(out.values())
    assert {"shapes/vqa/vqa_accuracy", "shapes/vqa/vqa_relation_flip/both_right", "shapes/caption/caption_match",
            "shapes/caption/caption_error/unparsable", "shapes/grounding/loc_iou50", "shapes/grounding/loc_miou",
            "shapes/t2i/t2i_match", "shapes/t2i/t2i_error/not_an_image"} <= set(logged)


# ---------------------------------------------------------------------------------------------
# DDP: states synced over 2 gloo ranks == one process over all the data
# ---------------------------------------------------------------------------------------------
def _sync_worker(rank, world_size, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics = _metrics()
        _update(metrics, lambda i: i % world_size == rank)  # rank 0: 3 examples, rank 1: 2
        computed = {task: m.compute() for task, m in metrics.items()}  # torchmetrics syncs the states here
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(computed))
    finally:
        dist.destroy_process_group()


def _assert_same(got: dict, want: dict) -> None:
    """Equal: counts and ratios of counts exactly, the IoU mean up to float64 rounding (partial sums)."""
    assert list(got) == list(want)
    for key in want:
        if key == "loc_miou":
            assert got[key] == pytest.approx(want[key], rel=want["loc_iou50_n"] * EPS64), key
        else:
            assert got[key] == want[key], key


@pytest.mark.timeout(180)
def test_metrics_synced_over_two_gloo_ranks_equal_one_process(tmp_path, fork_safe_threads):
    import torch.multiprocessing as mp

    one = _one_process()
    mp.start_processes(_sync_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert list(got) == list(one)
        for task in one:
            _assert_same(got[task], one[task])


def _fake_model(world: Path):
    """Outputs that are functions of the inputs: exact captions, a few answers, a fixed box, random scenes."""
    return standins.FakeModel(captions="world", draw="world", answers=["yes", "no", "red", "two"], world=str(world))


def _runner_worker(rank, world_size, init_file, world, out_dir):
    import torch.distributed as dist

    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics = shapes_task_accuracies(_fake_model(Path(world)), world, "test", limit=5, batch_size=2)
        Path(out_dir, f"runner{rank}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_the_runner_sharded_over_two_gloo_ranks_equals_one_process(tiny_shapes_world, tmp_path, fork_safe_threads):
    """5 rows per task on 2 ranks: rank 1 evaluates a padding repeat of row 0, counted once."""
    import torch.multiprocessing as mp

    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    one = shapes_task_accuracies(_fake_model(tiny_shapes_world), tiny_shapes_world, "test", limit=5, batch_size=2)
    assert one["vqa_accuracy_n"] == 5 and one["caption_match_n"] == 5
    mp.start_processes(_runner_worker, args=(2, str(tmp_path / "init"), str(tiny_shapes_world), str(tmp_path)),
                       nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        _assert_same(json.loads((tmp_path / f"runner{rank}.json").read_text()), one)


# ---------------------------------------------------------------------------------------------
# the epoch-end callback, as a training run builds it from eval=shapes_tasks
# ---------------------------------------------------------------------------------------------
def test_callback_logs_shapes_scalars_at_epoch_end(tiny_shapes_world, tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from unicon.config import compose
    from unicon.evaluation.callbacks import SuiteCallback
    from unicon.evaluation.shapes.runner import shapes_task_accuracies
    from unicon.loggers import JsonlLogger, read_metrics
    from unicon.training.trainer import make_eval_callbacks

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _fake_model(tiny_shapes_world)

        def training_step(self, batch, batch_idx):
            return (self.model.scale * batch).sum() * 0  # the fake model is not trained

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cfg = compose(["eval=shapes_tasks", f"data.root={tiny_shapes_world}", "eval.shapes.max_samples=3",
                   "eval.shapes.examples=1", "eval.fail_on_error=true"])
    callbacks = make_eval_callbacks(cfg)
    assert [(type(cb), cb.name) for cb in callbacks] == [(SuiteCallback, "shapes")]
    run_dir = tmp_path / "run"
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=JsonlLogger(run_dir), callbacks=callbacks,
                         default_root_dir=run_dir, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), DataLoader(torch.ones(2, 1), batch_size=1))

    logged = {k: v for row in read_metrics(run_dir / "metrics.jsonl") for k, v in row.items()}
    assert logged["shapes/failed"] == 0.0 and logged["shapes/seconds"] > 0
    direct = shapes_task_accuracies(_fake_model(tiny_shapes_world), tiny_shapes_world, "test", limit=3)
    assert {k: v for k, v in logged.items() if k not in ("shapes/failed", "shapes/seconds")
            and k.startswith("shapes/")} == logged_scalars(direct)
    for key in ("shapes/vqa/vqa_accuracy", "shapes/caption/caption_match", "shapes/grounding/loc_iou50",
                "shapes/t2i/t2i_match", "shapes/grounding/loc_miou", "shapes/vqa/vqa_accuracy_n"):
        assert key in logged, key
    assert logged["shapes/vqa/vqa_accuracy_n"] == 3
    out = run_dir / "eval" / "shapes" / "epoch-1"
    saved = json.loads((out / "shapes_eval.json").read_text())
    assert saved["metrics"] == direct and saved["limit"] == 3 and saved["split"] == "test"
    assert (out / "shapes_eval.png").is_file()


def test_evaluate_all_runs_the_shapes_tasks_group_with_its_settings(tiny_shapes_world, tmp_path, capsys):
    from unicon.cli import main as unicon_main

    ckpt = tmp_path / "ckpt"
    _fake_model(tiny_shapes_world).save_pretrained(str(ckpt))
    assert unicon_main(["evaluate", "all", "--ckpt", str(ckpt), "--device", "cpu", "--logger", "none",
                        "--out", str(tmp_path / "all"), "eval=shapes_tasks", f"data.root={tiny_shapes_world}",
                        "eval.shapes.max_samples=2", "eval.shapes.tasks=[vqa,grounding]",
                        "eval.shapes.examples=0"]) == 0
    assert [p.name for p in (tmp_path / "all").iterdir()] == ["shapes"]
    saved = json.loads((tmp_path / "all" / "shapes" / "shapes_eval.json").read_text())
    # --logger none: no W&B or CSV run, but metrics.jsonl, as in every suite
    (row,) = [json.loads(line) for line in (tmp_path / "all" / "shapes" / "metrics.jsonl").read_text().splitlines()]
    assert row["shapes/vqa/vqa_accuracy"] == saved["metrics"]["vqa_accuracy"]
    assert not (tmp_path / "all" / "shapes" / "csv").exists() and not (tmp_path / "all" / "shapes" / "wandb").exists()
    standins.assert_strict_json(tmp_path / "all")  # results and metrics: no NaN / Infinity
    assert saved["limit"] == 2 and saved["world"] == str(tiny_shapes_world.resolve())
    assert saved["metrics"]["vqa_accuracy_n"] == 2 and saved["metrics"]["loc_iou50_n"] == 2
    assert not any(k.startswith(("caption", "t2i")) for k in saved["metrics"])
    capsys.readouterr()
