"""The COCO training mixture (``data.source=coco``) and the experiments that train on it.

Everything runs on a small ShapesWorld exported in COCO / VQAv2 / RefCOCO formats, with contrast
sets built from it by ``unicon build-data cococon``: the two experiments (``ofa_large_cococon``,
``janus_pro_1b_cococon``) run 2 steps end to end through the real CLI with their model swapped for
a tiny config; the readers' bad-input errors and RefCOCO's pickle opt-in are checked on damaged
copies of the export.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from standins import SMALL_INSTRUCT  # noqa: E402
from unicon.config import compose  # noqa: E402
from unicon.data.coco_format import CocoFormatError  # noqa: E402
from unicon.data.coco_mixture import RefsFormatError, read_coco_mixture, read_refs  # noqa: E402
from unicon.data.mixture import ImageResize  # noqa: E402
from unicon.errors import UserError  # noqa: E402
from unicon.training.datamodule import ConsistencyDataModule  # noqa: E402
from unicon.training.run import cli  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A 12-scene ShapesWorld exported in COCO formats, with ``cococon/cococon.json`` built from its train split."""
    from data_builders import cococon as builder
    from data_builders.shapes import main as build_shapes

    root = tmp_path_factory.mktemp("cocomix") / "world"
    build_shapes(["--out", str(root), "--num-train", "12", "--num-val", "2", "--num-test", "2", "--quiet",
                  "--num-reason-train", "0", "--num-ureason", "1", "--geneval-per-tag", "1", "--num-drift-seeds", "1",
                  "--vocab-size", "300", "--coco-format", *SMALL_INSTRUCT])
    c = root / "coco"
    assert builder.main(["--captions", str(c / "captions_train.json"), "--questions", str(c / "questions_train.json"),
                         "--annotations", str(c / "vqa_annotations_train.json"),
                         "--instances", str(c / "instances_train.json"), "--images", str(root),
                         "--out", str(root / "cococon"), "--candidates", "vocab", "--lm", "none", "--lexical", "none",
                         "--shards", "1", "--workers", "1", "--quiet"]) == 0
    return root


def data_overrides(world: Path, coco: Path | None = None) -> list[str]:
    """The data keys of configs/data/coco.yaml pointed at the export (``coco``: a copy of its files)."""
    c = coco or world / "coco"
    return [f"data.root={world}", f"data.coco_images={world}", f"data.captions_file={c / 'captions_train.json'}",
            f"data.vqa_questions_file={c / 'questions_train.json'}",
            f"data.vqa_annotations_file={c / 'vqa_annotations_train.json'}",
            f"data.refcoco_files=[{c / 'refs_train.json'}]",
            f"data.refcoco_instances_file={c / 'instances_train.json'}",
            f"data.contrast_file={world / 'cococon' / 'cococon.json'}", f"data.images_root={world}"]


def data_cfg(world: Path, *extra: str, coco: Path | None = None):
    return compose(["data=coco", *data_overrides(world, coco), *extra]).data


def export_rows(world: Path, name: str) -> list:
    return json.loads((world / "coco" / name).read_text())


# ---------------------------------------------------------------------------------------------
# The experiments, 2 steps each
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experiment, tiny_model", [("ofa_large_cococon", "ofa_shapes_tiny"),
                                                     ("janus_pro_1b_cococon", "janus_tiny")])
def test_experiment_runs_two_steps(world, tmp_path, experiment, tiny_model, fork_safe_threads, capsys):
    """`unicon train experiment=X model=<tiny>` on the export, images decoded in a loader worker:
    with seed 0 the first step is a consistency update and the second a standard one, and the run
    writes its checkpoint and export."""
    draws = torch.rand(2, generator=torch.Generator().manual_seed(0)).tolist()
    assert draws[0] < 0.5 <= draws[1]  # seed 0: step 1 is a consistency update, step 2 a standard one
    out = tmp_path / "runs"
    assert cli([f"experiment={experiment}", f"model={tiny_model}", "trainer=cpu", "eval=none", "logger=csv",
                *data_overrides(world), "data.batch_size=8", "data.num_workers=1", "trainer.max_steps=2",
                "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", f"output_dir={out}",
                "name=two_steps"]) == 0
    run_dir = out / "two_steps"
    config = (run_dir / "config.yaml").read_text()
    assert "source: coco" in config and "lambda_: 0.25" in config and "warmup_ratio: 0.1" in config
    assert (run_dir / "export").is_dir() and (run_dir / "last.ckpt").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = {k: v for r in rows for k, v in r.items()}
    assert last["train/consistency_updates"] == 1 and last["train/standard_updates"] == 1
    assert "checkpoint:" in capsys.readouterr().out


def test_experiment_configs_hold_table_5(world):
    cfg = compose(["experiment=ofa_large_cococon"])
    assert (cfg.optim.lr, cfg.optim.warmup_ratio, cfg.loss.lambda_, cfg.loss.gamma, cfg.trainer.max_epochs) == \
        (1e-6, 0.1, 0.25, 0.5, 1)
    assert cfg.trainer.strategy == "deepspeed_zero2" and cfg.data.source == "coco"
    janus = compose(["experiment=janus_pro_1b_cococon", "data.coco_root=/coco"])
    assert janus.model.backend == "janus" and janus.data.captions_file == "/coco/annotations/captions_train2014.json"
    assert janus.eval.cococon.images_root == "/coco/val2014"


def test_missing_file_names_the_key(world, tmp_path):
    cfg = compose(["experiment=ofa_large_cococon", f"data.coco_root={tmp_path}", f"data.coco_images={world}"]).data
    with pytest.raises(UserError, match=r"data\.captions_file: file not found: .*captions_train2014\.json"):
        read_coco_mixture(cfg)
    with pytest.raises(UserError, match=r"data\.coco_images: image folder not found"):
        read_coco_mixture(data_cfg(world, f"data.coco_images={tmp_path / 'nowhere'}"))
    with pytest.raises(UserError, match=r"data\.refcoco_files\[0\]: file not found"):
        read_coco_mixture(data_cfg(world, f"data.refcoco_files=[{tmp_path / 'refs.json'}]"))


# ---------------------------------------------------------------------------------------------
# Rows, images, preprocessing
# ---------------------------------------------------------------------------------------------
def test_rows_of_each_task_come_from_their_files(world):
    rows, report = read_coco_mixture(data_cfg(world))
    captions = export_rows(world, "captions_train.json")["annotations"]
    questions = export_rows(world, "questions_train.json")["questions"]
    refs = export_rows(world, "refs_train.json")["refs"]
    assert dict(report.rows) == {"caption": len(captions), "t2i": len(captions), "vqa": len(questions),
                                 "grounding": sum(len(r["sentences"]) for r in refs)}
    assert report.missing_images == 0
    ground = {r["id"]: (r["text"], r["target"]) for r in rows if r["task"] == "grounding"}
    for ref in refs:  # the box comes from the instances file through ann_id; the export also records it
        assert ground[f"ref-refs_train-{ref['ref_id']}-0"] == (ref["sentences"][0]["sent"], ref["bbox"])
    only = read_coco_mixture(data_cfg(world, "data.tasks=[vqa]"))[0]
    assert {r["task"] for r in only} == {"vqa"}
    with pytest.raises(UserError, match="reason.*no COCO source"):
        read_coco_mixture(data_cfg(world, "data.tasks=[caption,reason]"))


def test_missing_images_are_counted_and_skipped(world, tmp_path, caplog):
    images = tmp_path / "images_root"
    shutil.copytree(world / "images", images / "images")
    gone = sorted((images / "images" / "train").glob("*.png"))[:2]
    for p in gone:
        p.unlink()
    cfg = data_cfg(world, f"data.coco_images={images}")
    with caplog.at_level("WARNING"):
        rows, report = read_coco_mixture(cfg)
    assert report.missing_images == 2 and sum(report.skipped_rows.values()) > 0
    assert all(r["image"] not in {f"images/train/{p.name}" for p in gone} for r in rows)
    assert sum("2 of 12 images are missing" in m for m in caplog.messages) == 1  # reported once
    full = read_coco_mixture(data_cfg(world))[1]
    assert sum(report.rows.values()) + sum(report.skipped_rows.values()) == sum(full.rows.values())


def test_worker_resize_scales_boxes_with_the_image(world):
    """ImageResize in the dataset (the backend's geometry, applied in the workers): the box normalised
    by the image size -- what score_boxes encodes -- is unchanged; contrast boxes scale likewise."""
    half = ImageResize(32, keep_aspect=True)
    plain = ConsistencyDataModule(data_cfg(world))
    resized = ConsistencyDataModule(data_cfg(world), image_resize=half)
    plain.setup(), resized.setup()
    for i, row in enumerate(plain.mixture.rows):
        a, b = plain.mixture[i], resized.mixture[i]
        assert a["image"].size == (64, 64) and b["image"].size == (32, 32)
        if row["task"] == "grounding":
            assert b["target"] == [v / 2 for v in a["target"]]
    boxed = next(i for i, s in enumerate(plain.contrast.data) if s.boxes)
    gold = plain.contrast[boxed]["sample"].boxes
    assert resized.contrast[boxed]["sample"].boxes == [[v / 2 for v in box] for box in gold]
    assert ImageResize(480, keep_aspect=False).size(640, 427) == (480, 480)
    assert ImageResize(384, keep_aspect=True, min_side=14).size(640, 20) == (384, 14)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def damaged_copy(world: Path, tmp_path: Path, name: str, damage) -> Path:
    coco = tmp_path / "coco"
    shutil.copytree(world / "coco", coco)
    data = json.loads((coco / name).read_text())
    damage(data)
    (coco / name).write_text(json.dumps(data))
    return coco


@pytest.mark.parametrize("name, damage, message", [
    ("captions_train.json", lambda d: d["annotations"][3].pop("caption"),
     r"captions_train\.json: annotations\[3\] \(id 4\): missing key 'caption'"),
    ("vqa_annotations_train.json", lambda d: d["annotations"][1].update(multiple_choice_answer=7),
     r"vqa_annotations_train\.json: annotations\[1\] \(question_id \d+\): 'multiple_choice_answer' must be str"),
    ("refs_train.json", lambda d: d["refs"][2].pop("ann_id"),
     r"refs_train\.json: refs\[2\] \(ref_id 3\): missing key 'ann_id'"),
    ("refs_train.json", lambda d: d["refs"][0].update(sentences=[{"raw": "x"}]),
     r"refs_train\.json: refs\[0\] \(ref_id 1\): sentences\[0\] must be an object with a string 'sent'"),
    ("instances_train.json", lambda d: d["annotations"][0].update(bbox=[1, 2]),
     r"instances_train\.json: annotations\[0\] \(id 1\): 'bbox' must be \[x, y, w, h\]"),
])
def test_malformed_records_name_the_file_and_record(world, tmp_path, name, damage, message):
    coco = damaged_copy(world, tmp_path, name, damage)
    with pytest.raises((CocoFormatError, RefsFormatError), match=message):
        read_coco_mixture(data_cfg(world, coco=coco))


def test_truncated_files_and_dangling_ids(world, tmp_path):
    coco = tmp_path / "coco"
    shutil.copytree(world / "coco", coco)
    text = (coco / "captions_train.json").read_text()
    (coco / "captions_train.json").write_text(text[: len(text) // 2])
    with pytest.raises(CocoFormatError, match=r"captions_train\.json: malformed or truncated COCO captions file"):
        read_coco_mixture(data_cfg(world, coco=coco))
    (coco / "captions_train.json").write_text(text)
    (coco / "refs_train.json").write_text('{"refs": [')
    with pytest.raises(RefsFormatError, match=r"refs_train\.json: malformed refs JSON"):
        read_coco_mixture(data_cfg(world, coco=coco))
    refs = export_rows(world, "refs_train.json")
    refs["refs"][0]["ann_id"] = 10**6
    (coco / "refs_train.json").write_text(json.dumps(refs))
    with pytest.raises(UserError, match=r"refs_train\.json: ref_id 1: ann_id 1000000 is not in data\.refcoco_inst"):
        read_coco_mixture(data_cfg(world, coco=coco))


# ---------------------------------------------------------------------------------------------
# RefCOCO: JSON conversions by default, the pickle only with data.allow_pickle
# ---------------------------------------------------------------------------------------------
def test_refs_formats_and_the_pickle_opt_in(world, tmp_path):
    refs = export_rows(world, "refs_train.json")["refs"]
    expected = read_refs(world / "coco" / "refs_train.json", "train")
    assert len(expected) == len(refs) and expected[0]["sentences"] == [refs[0]["sentences"][0]["sent"]]
    (tmp_path / "refs.json").write_text(json.dumps(refs))  # the released pickle's content, as JSON
    (tmp_path / "refs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in refs))
    with (tmp_path / "refs(unc).p").open("wb") as f:
        pickle.dump(refs, f, protocol=2)  # the released files are Python 2 pickles
    assert read_refs(tmp_path / "refs.json", "train") == expected
    assert read_refs(tmp_path / "refs.jsonl", "train") == expected
    assert read_refs(tmp_path / "refs.json", "testA") == []
    with pytest.raises(RefsFormatError, match=r"refs\(unc\)\.p is a pickle.*data\.allow_pickle=true"):
        read_refs(tmp_path / "refs(unc).p", "train")
    assert read_refs(tmp_path / "refs(unc).p", "train", allow_pickle=True) == expected
    with (tmp_path / "objects.p").open("wb") as f:  # opted in, still no class is instantiated
        pickle.dump([OrderedDict(ref_id=1)], f)
    with pytest.raises(RefsFormatError, match=r"references collections\.OrderedDict"):
        read_refs(tmp_path / "objects.p", "train", allow_pickle=True)
    cfg = data_cfg(world, f"data.refcoco_files=[{tmp_path / 'refs(unc).p'}]")
    with pytest.raises(RefsFormatError, match="is a pickle"):
        read_coco_mixture(cfg)
    pickled = read_coco_mixture(data_cfg(world, f"data.refcoco_files=[{tmp_path / 'refs(unc).p'}]",
                                         "data.allow_pickle=true"))[1]
    assert pickled.rows == read_coco_mixture(data_cfg(world))[1].rows
