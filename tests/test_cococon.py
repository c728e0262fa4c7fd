"""CocoCon: loader errors, Eq. 1/2 and rho by hand, an independent re-implementation over
per_sample.jsonl, the real 1,500-sample file end to end, and ``evaluate_model`` on 2 gloo ranks
== 1 process (long generated captions arrive whole)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

import standins
from unicon import jsonsafe
from unicon.data.cococon import CocoConFormatError, load_cococon
from unicon.evaluation.cococon import metrics, runner
from unicon.evaluation.distributed import padding_repeats
from unicon.evaluation.callbacks import SuiteCallback
from unicon.evaluation.suites import suite

cli = suite("cococon").cli


# ---------------------------------------------------------------------------------------------
# The test double: standins.FakeModel (NLLs from crc32 of the inputs), set up for CocoCon
# ---------------------------------------------------------------------------------------------
#: the contrast word "tie" scores like the gold word "red" in T2I (exercises tie counting); answers
#: alternate with the question's length; generated images are grey levels of the prompt
HASH = dict(score_alias={"tie": "red"}, captions="a child in a bed", answers=["2", "Blanket."], draw="gray")


def HashModel(**options) -> standins.FakeModel:
    return standins.FakeModel(**{**HASH, **options})


# ---------------------------------------------------------------------------------------------
# Independent reference: plain loops over per_sample.jsonl (no code shared with the module)
# ---------------------------------------------------------------------------------------------
def _ranks(v):
    """Average ranks (1-based) with ties sharing the mean rank."""
    idx = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and v[idx[j + 1]] == v[idx[i]]:
            j += 1
        for m in range(i, j + 1):
            r[idx[m]] = (i + j) / 2 + 1
        i = j + 1
    return r


def _spearman(x, y):
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return None if den == 0 else num / den


def reference_metrics(rows, task, max_k=5):
    hits = {k: [] for k in range(1, max_k + 1)}
    ties = {k: 0 for k in range(1, max_k + 1)}
    rhos, undefined = [], 0
    for row in rows:
        cap, tsk = row["nll"]["caption"], row["nll"][task]
        if tsk is None:
            continue
        js = [j for j in range(1, len(cap)) if tsk[j] is not None]
        if not js:
            continue
        js.sort(key=lambda j: (cap[j], j))
        for k, j in enumerate(js[:max_k], 1):
            gold_cap, gold_task = cap[0] < cap[j], tsk[0] < tsk[j]
            con_cap, con_task = cap[0] > cap[j], tsk[0] > tsk[j]
            hits[k].append((gold_cap and gold_task) or (con_cap and con_task))
            ties[k] += cap[0] == cap[j] or tsk[0] == tsk[j]
        rho = _spearman([cap[0]] + [cap[j] for j in js], [tsk[0]] + [tsk[j] for j in js])
        if rho is None:
            undefined += 1
        else:
            rhos.append(rho)
    C = {k: (100.0 * sum(v) / len(v) if v else None) for k, v in hits.items()}
    n = {k: len(v) for k, v in hits.items()}
    return C, n, ties, (sum(rhos) / len(rhos) if rhos else None), undefined


def check_against_reference(results, rows, tasks=metrics.TASKS):
    for task in tasks:
        C, n, ties, rho, undefined = reference_metrics(rows, task)
        r = results[task]
        for k in range(1, 6):
            key = str(k) if str(k) in r["n_k"] else k
            assert r["n_k"][key] == n[k], (task, k)
            assert r["ties_k"][key] == ties[k], (task, k)
            if C[k] is None:
                assert r["C_k"][key] is None or math.isnan(r["C_k"][key])
            else:
                assert r["C_k"][key] == pytest.approx(C[k], abs=1e-9), (task, k)
        assert r["rho_undefined"] == undefined, task
        if rho is not None:
            assert r["rho"] == pytest.approx(rho, abs=1e-9), task


# ---------------------------------------------------------------------------------------------
# Hand-computed metric cases
# ---------------------------------------------------------------------------------------------
def test_sample_consistency_by_hand():
    # caption order of contrasts by NLL: col2 (0.5), col1 (2.0), col3 (3.0)
    r = metrics.sample_consistency([1.0, 2.0, 0.5, 3.0], [1.0, 1.5, 2.0, 0.2], max_k=5)
    assert r["order"] == [1, 0, 2]
    # k=1: caption prefers contrast, task prefers gold -> 0; k=2: gold in both -> 1; k=3: 0
    assert r["consistent"] == [False, True, False]
    assert r["tie"] == [False, False, False]
    assert r["task_acc"] == [True, True, False]
    assert r["caption_acc"] == [False, True, True]
    # ranks x = [2,3,1,4], y = [2,3,4,1]; sum d^2 = 18 -> 1 - 6*18/(4*15) = -0.8
    assert r["rho"] == pytest.approx(-0.8)


def test_both_prefer_contrast_is_consistent():
    r = metrics.sample_consistency([2.0, 1.0], [5.0, 4.0], max_k=5)
    assert r["consistent"] == [True] and r["task_acc"] == [False] and r["rho"] == pytest.approx(1.0)


def test_ties_are_inconsistent_and_counted():
    r = metrics.sample_consistency([1.0, 1.0, 2.0], [0.0, 1.0, 1.0], max_k=5)
    assert r["consistent"] == [False, True] and r["tie"] == [True, False]
    # average ranks x = [1.5,1.5,3], y = [1,2.5,2.5] -> Pearson of ranks = 0.75 / 1.5
    assert r["rho"] == pytest.approx(0.5)


def test_constant_vector_rho_undefined_and_excluded():
    rows = [
        metrics.sample_consistency([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], max_k=5),  # constant task scores
        metrics.sample_consistency([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], max_k=5),  # rho = 1
        metrics.sample_consistency([1.0, 2.0], [3.0, 1.0], max_k=5),  # rho = -1
    ]
    assert rows[0]["rho"] is None and rows[0]["tie"] == [True, True]
    agg = metrics.aggregate(rows, max_k=5)
    assert agg["rho"] == pytest.approx(0.0) and agg["rho_n"] == 2 and agg["rho_undefined"] == 1
    # k=1: [tie -> 0, 1, 0] ; k=2: [0, 1] (third sample has a single contrast)
    assert agg["C_k"][1] == pytest.approx(100 / 3) and agg["n_k"][1] == 3 and agg["ties_k"][1] == 1
    assert agg["C_k"][2] == pytest.approx(50.0) and agg["n_k"][2] == 2
    assert agg["n_k"][3] == 0 and math.isnan(agg["C_k"][3])
    assert agg["acc@k"][1] == pytest.approx(100 / 3)


def test_missing_contrasts_ranked_among_present_ones():
    nan = float("nan")
    # localization: contrast 2 has no mutex_detection; ranking uses contrasts 1 and 3 only
    r = metrics.sample_consistency([1.0, 3.0, 0.1, 2.0], [1.0, 0.5, nan, 2.0], max_k=5)
    assert r["order"] == [2, 0] and r["consistent"] == [True, False]
    assert metrics.sample_consistency([1.0, 2.0], [nan, nan], max_k=5)["consistent"] == []


def test_generative_helpers():
    assert metrics.normalize_answer("Two Dogs.") == "2 dogs"
    assert metrics.normalize_answer("the blanket!") == "blanket"
    assert metrics.vqa_soft_accuracy("yes", ["yes"] * 3 + ["no"] * 7) == pytest.approx((7 * 1.0 + 3 * 2 / 3) / 10)
    assert metrics.normalize_answer("A cat's toy, an apple\nand 'ten' cats") == "cat's toy apple and 10 cats"
    assert metrics.box_iou([0, 0, 2, 2], [1, 1, 2, 2]) == pytest.approx(1 / 7)
    assert metrics.box_iou([0, 0, 10, 10], [5, 0, 10, 10]) == pytest.approx(50 / 150)
    assert metrics.box_iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0  # empty boxes: 0, not 0 / 0
    assert metrics.box_iou([5, 5, -3, 4], [0, 0, 10, 10]) == 0.0  # an inverted box is empty
    refs = {0: ["a cat on a mat"], 1: ["a dog in the park"]}
    perfect, _ = metrics.cider_score(refs, {0: "a cat on a mat", 1: "a dog in the park"}, tokenizer="simple")
    wrong, _ = metrics.cider_score(refs, {0: "a dog in the park", 1: "a cat on a mat"}, tokenizer="simple")
    assert perfect > 100.0 and wrong < perfect


# ---------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------
def _mini_file(tmp_path: Path, n: int = 7) -> Path:
    """A small CocoCon-schema file (with a zero-contrast sample, a ragged localization sample,
    an upper-case gold caption and a T2I tie) plus its images."""
    (tmp_path / "images").mkdir(exist_ok=True)
    anns, images = [], []
    for i in range(n):
        Image.new("RGB", (32 + i, 24), (20 * i, 100, 50)).save(tmp_path / "images" / f"{i}.png")
        images.append({"id": 100 + i, "file_name": f"images/{i}.png", "width": 32 + i, "height": 24})
        k = i % 5 + 1
        ann = {
            "id": i, "question_id": 1000 + i, "image_id": 100 + i, "category": ["attribute", "object"][i % 2],
            "caption": f"A Red circle left of shape {i}", "query": f"what is left of shape {i}?", "answer": "Circle",
            "contrast_sets": [{"mutex_caption": f"a {c} circle left of shape {i}", "mutex_answer": c}
                              for c in ["blue", "green", "tie", "gray", "cyan"][:k]],
        }
        if i % 3 == 0:
            ann["detection"], ann["boxes"] = "circle", [[1, 2, 10, 8], [5, 5, 3, 3]]
            for j, cs in enumerate(ann["contrast_sets"]):
                if j != 1:
                    cs["mutex_detection"] = cs["mutex_answer"] + " circle"
        anns.append(ann)
    anns[1]["contrast_sets"] = []
    anns[2]["answers"] = ["circle"] * 4 + ["square"] * 6
    path = tmp_path / "mini.json"
    path.write_text(json.dumps({"annotations": anns, "images": images}, indent=1))
    return path


def test_loader_reports_and_keeps_ids(tmp_path):
    path = _mini_file(tmp_path)
    data = load_cococon(path)
    assert len(data) == 7 and data.images_root == tmp_path
    s = data[3]
    assert (s.id, s.question_id, s.image_id, s.category) == (3, 1003, 103, "object")
    assert s.image_path == tmp_path / "images/3.png" and s.image_size == (35, 24)
    assert s.has_localization and s.boxes[0] == [1.0, 2.0, 10.0, 8.0]
    assert [c.detection for c in s.contrast_sets] == ["blue circle", None, "tie circle", "gray circle"]
    assert data.report.no_contrast_sets == [1]
    bad = json.loads(path.read_text())
    del bad["annotations"][0]["detection"]
    path.write_text(json.dumps(bad))
    rep = load_cococon(path).report
    assert rep.boxes_without_detection == [0] and rep.num_localization == 2


def test_malformed_json_names_file_and_position(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"annotations": [\n  {"id": 1,\n   "caption": "x" "query": "y"}\n]}')
    with pytest.raises(CocoConFormatError, match=r"broken\.json: malformed JSON at line 3, column 19"):
        load_cococon(p)


def test_missing_key_names_annotation(tmp_path):
    path = _mini_file(tmp_path)
    bad = json.loads(path.read_text())
    del bad["annotations"][4]["answer"]
    path.write_text(json.dumps(bad))
    with pytest.raises(CocoConFormatError, match=r"annotations\[4\]: missing key 'answer'"):
        load_cococon(path)


def test_missing_image_error_and_skip_missing(tmp_path):
    path = _mini_file(tmp_path)
    (tmp_path / "images" / "5.png").unlink()
    with pytest.raises(CocoConFormatError, match=r"image file not found: .*images/5\.png"):
        load_cococon(path)
    data = load_cococon(path, skip_missing=True)
    assert len(data) == 6 and 5 not in [s.id for s in data]
    assert data.report.missing_images == [str(tmp_path / "images" / "5.png")]
    with pytest.raises(CocoConFormatError, match="not a directory"):
        load_cococon(path, images_root=tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# Scoring through the interface + independent check on the written files
# ---------------------------------------------------------------------------------------------
def test_scoring_end_to_end_matches_reference(tmp_path):
    data = load_cococon(_mini_file(tmp_path))
    model = HashModel()
    result = runner.evaluate_model(model, data.samples, batch_size=3, cider_tokenizer="simple")
    assert {"score_text", "score_boxes", "score_image"} <= {name for name, _ in model.calls}
    out = tmp_path / "out"
    import matplotlib

    backend = matplotlib.get_backend()
    runner.write_outputs(result, out)
    assert matplotlib.get_backend() == backend  # the plots leave the caller's backend alone
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "per_sample.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(7))
    # gold and contrast captions normalised the same way (gold was upper-case in the file)
    assert rows[0]["caption"] == "a red circle left of shape 0"
    # the "tie" contrast gets the gold's T2I score -> counted as a tie and inconsistent
    assert sum(results["t2i"]["ties_k"].values()) > 0
    assert rows[3]["nll"]["localization"][2] is None and rows[4]["nll"]["localization"] is None
    check_against_reference(results, rows)
    gen = results["generative"]
    assert gen["vqa_soft_n"] == 1 and gen["localization_n"] == 3 and gen["t2i_scene_match"] == "unavailable"
    # locate() returns the top-left quarter; IoU with [1,2,10,8] on 32x24 is 80/192 -> no hit
    assert gen["localization_acc@0.5"] == pytest.approx(0.0)
    assert (out / "consistency_by_k.png").is_file() and (out / "consistency_vs_accuracy.png").is_file()
    flat = result.flat()
    assert flat["cococon/vqa/C_1"] == results["vqa"]["C_k"]["1"] and "cococon/t2i/rho" in flat
    assert "cococon/category/object/vqa/C_1" in flat


def test_probe_words_report_the_samples_that_name_them(tmp_path):
    """probe_words (a knowledge-gap concept): the samples whose gold answer names a word are
    aggregated on their own, equal to the reference over exactly those rows."""
    path = _mini_file(tmp_path, n=8)
    raw = json.loads(path.read_text())
    for i, answer in ((0, "Grays"), (3, "gray"), (4, "grayish"), (5, "a gray one"), (6, "cubes"), (7, "cube")):
        raw["annotations"][i]["answer"] = answer
    path.write_text(json.dumps(raw))
    data = load_cococon(path)
    result = runner.evaluate_model(HashModel(), data.samples, batch_size=3, cider_tokenizer="simple",
                                   probe_words=["Gray", "cube"])
    runner.write_outputs(result, tmp_path / "out")
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "out" / "per_sample.jsonl").read_text().splitlines()]
    named = {"Gray": [r for r in rows if r["id"] in (0, 3, 5)],  # "grayish" is another word
             "cube": [r for r in rows if r["id"] in (6, 7)]}
    probe = results["probe"]
    assert probe["num_samples"] == 5 and probe["words"] == ["Gray", "cube"]
    check_against_reference(probe, named["Gray"] + named["cube"])
    flat = result.flat()
    for word, word_rows in named.items():  # each concept on its own
        check_against_reference(probe["by_word"][word], word_rows)
        assert flat[f"cococon/probe/{word}/num_samples"] == len(word_rows)
        hardest = [r["nll"]["caption"][0] < r["nll"]["caption"][1 + r["vqa"]["order"][0]] for r in word_rows]
        assert flat[f"cococon/probe/{word}/caption/acc@1"] == pytest.approx(100.0 * sum(hardest) / len(hardest))
    assert flat["cococon/probe/vqa/C_1"] == probe["vqa"]["C_k"]["1"] and flat["cococon/probe/num_samples"] == 5
    assert "probe" not in runner.evaluate_model(HashModel(), data.samples, cider_tokenizer="simple").results


def test_real_cococon_file_flows_through(shared_data, tmp_path):
    src = shared_data / "cococon" / "cococon.json"
    raw = json.loads(src.read_text())
    for im in raw["images"]:  # small placeholders (the test double ignores box coordinates)
        Image.new("RGB", (im["width"] // 8, im["height"] // 8), (im["id"] % 251, 90, 160)).save(tmp_path / im["file_name"])
    data = load_cococon(src, images_root=tmp_path)
    rep = data.report
    assert (len(data), rep.num_contrast_sets, rep.num_localization) == (1500, 5091, 443)
    assert rep.no_contrast_sets == [] and rep.missing_images == []
    result = runner.evaluate_model(HashModel(), data.samples, batch_size=64, generative=False)
    r = result.results
    assert r["num_samples"] == 1500 and r["vqa"]["n_k"][1] == 1500 and r["localization"]["n_k"][1] == 443
    assert r["t2i"]["n_k"][5] == 602  # samples with 5 contrast sets
    rows = json.loads(json.dumps(result.per_sample))
    check_against_reference(json.loads(json.dumps(r)), rows)


def test_cli_writes_results(tmp_path, monkeypatch):
    import unicon.models
    from unicon.config import CocoConEvalConfig
    parser = suite("cococon").parser
    from unicon.core import weights_fingerprint

    path = _mini_file(tmp_path)
    monkeypatch.setattr(unicon.models, "load_model", lambda p, **kw: HashModel(), raising=False)
    out = tmp_path / "cli"
    ckpt = tmp_path / "ckpt"  # a directory: the double loads nothing from it
    ckpt.mkdir()
    rc = cli(["--ckpt", str(ckpt), "--data", str(path), "--out", str(out), "--logger", "csv",
              "--max-samples", "5", "--cider-tokenizer", "simple", "--image-seed", "3"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["num_samples"] == 5
    assert results["model_fingerprint"] == weights_fingerprint(HashModel())
    assert {"versions.python", "versions.torch"} <= set(results["environment"])
    assert results["generation"]["image"]["seed"] == 3
    assert results["generation"]["caption_prompt"] == standins.FakeModel.caption_prompt
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("cococon/vqa/C_1" in m for m in logged)
    assert (out / "tables" / "cococon_samples.jsonl").is_file()
    from unicon.errors import UserError

    with pytest.raises(UserError, match="--max-samples must be >= 1, got 0"):
        cli(["--ckpt", str(ckpt), "--data", str(path), "--out", str(out), "--max-samples", "0"])
    with pytest.raises(UserError, match=r"image file not found: .*images/0\.png.*--images"):
        cli(["--ckpt", str(ckpt), "--data", str(path), "--out", str(tmp_path / "other"), "--images", str(out)])
    # the flags are eval.cococon's fields, with its defaults (--max-samples: the whole file; --images: images_root)
    args, config = parser().parse_args(["--ckpt", "x", "--data", "x", "--out", "x"]), CocoConEvalConfig()
    for name in ("batch_size", "table_rows", "tasks", "generative", "skip_missing", "probe_words", "images_root"):
        assert getattr(args, name) == getattr(config, name), name
    assert args.max_samples is None
    assert parser().parse_args(["--ckpt", "x", "--data", "x", "--out", "x", "--images", "im"]).images_root == "im"


# ---------------------------------------------------------------------------------------------
# DDP: evaluate_model (the path the callback takes) on 2 gloo ranks == 1 process
# ---------------------------------------------------------------------------------------------
def LongCaptionModel() -> standins.FakeModel:
    """Generated captions of about 600 UTF-8 bytes, multi-byte characters included."""
    return HashModel(captions="{width}: " + "ein Kind schläft unter einer grünen Decke " * 14)


def _ddp_worker(rank, world, init_file, data_path, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        data = load_cococon(data_path)
        # 7 samples over 2 ranks: shard_indices pads rank 1 with a repeat of sample 0
        result = runner.evaluate_model(LongCaptionModel(), data.samples, batch_size=2, cider_tokenizer="simple")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([result.results, result.per_sample]))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_ddp_two_ranks_match_single_process(tmp_path, fork_safe_threads):
    import torch.multiprocessing as mp

    path = _mini_file(tmp_path)
    single = runner.evaluate_model(LongCaptionModel(), load_cococon(path).samples, batch_size=4,
                                   cider_tokenizer="simple")
    expected = json.loads(json.dumps([single.results, single.per_sample]))
    captions = [row["generated"]["caption"] for row in expected[1]]
    assert all(len(c.encode()) > 256 for c in captions)
    assert captions[0] == "32: " + "ein Kind schläft unter einer grünen Decke " * 14  # image 0 is 32 pixels wide
    # fork: the children inherit the imported modules (spawn would re-import torch/torchmetrics twice)
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "init"), str(path), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == expected


def test_padding_repeats_are_the_samples_a_lower_rank_holds():
    assert padding_repeats(7, 0, 2) == set() and padding_repeats(7, 1, 2) == {0}
    assert padding_repeats(8, 1, 2) == set()
    # more ranks than samples: ranks 2.. only repeat
    assert [padding_repeats(2, r, 5) for r in range(5)] == [set(), set(), {0}, {1}, {0}]


# ---------------------------------------------------------------------------------------------
# The real tiny OFA (random init) on a small ShapesWorld, through `unicon evaluate cococon`
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_world_model(tmp_path_factory):
    from omegaconf import OmegaConf

    from data_builders.shapes import main as build_shapes
    from unicon.models import build_model

    root = tmp_path_factory.mktemp("shapes")
    world = root / "world"
    build_shapes(["--out", str(world), "--num-train", "8", "--num-val", "2", "--num-test", "12", "--quiet",
                  "--num-reason-train", "2", "--num-ureason", "1", "--geneval-per-tag", "1",
                  "--num-drift-seeds", "1", "--vocab-size", "300", *standins.SMALL_INSTRUCT])
    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "configs" / "model" / "ofa_shapes_tiny.yaml")
    torch.manual_seed(0)
    model = build_model(cfg, world_root=world)
    model.save_pretrained(str(root / "model"))
    return world, root / "model"


def test_cli_with_tiny_ofa_on_shapesworld(tiny_world_model, tmp_path):
    world, ckpt = tiny_world_model
    out = tmp_path / "out"
    rc = cli(["--ckpt", str(ckpt), "--data", str(world / "cococon_test.json"), "--out", str(out),
              "--logger", "csv", "--max-samples", "8", "--batch-size", "8", "--cider-tokenizer", "simple"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "per_sample.jsonl").read_text().splitlines()]
    assert results["num_samples"] == 8 and len(rows) == 8
    for task in metrics.TASKS:
        assert results[task]["n_k"]["1"] > 0
    check_against_reference(results, rows)
    gen = results["generative"]
    # a world root with world.json enables the exact ShapesWorld T2I check; FID needs weights
    assert isinstance(gen["t2i_scene_match"], float) and gen["t2i_fid"] == "unavailable"
    assert 0.0 <= gen["vqa_accuracy"] <= 100.0 and gen["localization_n"] == results["localization"]["n_k"]["1"]
    assert set(results["truncated_candidates"]) == {"caption", "vqa", "localization", "t2i"}


@pytest.mark.shared
def test_cli_with_the_ofa_reference_fixture(ofa_fixture_dir, tiny_world_model, tmp_path):
    """`model=ofa_reference_tiny` (the OFA-Sys parity fixture) scores CocoCon end to end.

    It has no image tokenizer, so T2I is left out; its checkpoint ships no BPE files (byte-level text).
    """
    world, _ = tiny_world_model
    out = tmp_path / "out"
    rc = cli(["--ckpt", str(ofa_fixture_dir), "--data", str(world / "cococon_test.json"), "--out", str(out),
              "--logger", "none", "--max-samples", "6", "--tasks", "vqa", "localization",
              "--cider-tokenizer", "simple"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "per_sample.jsonl").read_text().splitlines()]
    assert results["num_samples"] == 6 and results["vqa"]["n_k"]["1"] == 6
    check_against_reference(results, rows, tasks=("vqa", "localization"))


# ---------------------------------------------------------------------------------------------
# Epoch-end callback inside a Lightning run
# ---------------------------------------------------------------------------------------------
def test_callback_logs_metrics_and_table(tmp_path):
    import lightning.pytorch as pl
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from unicon.config import RunConfig
    from unicon.loggers import JsonlLogger, read_metrics

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = HashModel()

        def training_step(self, batch, batch_idx):
            return (self.model.scale * batch).sum() * 0  # the fake model is not trained

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    path = _mini_file(tmp_path)
    cfg = OmegaConf.structured(RunConfig)
    cfg.eval.cococon.data, cfg.eval.cococon.max_samples, cfg.eval.cococon.table_rows = str(path), 6, 3
    cfg.eval.fail_on_error = True
    callback = SuiteCallback.from_config(suite("cococon"), cfg)
    assert (callback.config.max_samples, callback.config.batch_size, callback.every_n_epochs) == (6, 16, 1)
    run_dir = tmp_path / "run"
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=JsonlLogger(run_dir), callbacks=[callback],
                         default_root_dir=run_dir, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), DataLoader(torch.ones(2, 1), batch_size=1))
    logged = {k: v for row in read_metrics(run_dir / "metrics.jsonl") for k, v in row.items()}
    assert logged["cococon/failed"] == 0.0
    results = json.loads((run_dir / "eval" / "cococon" / "epoch-1" / "results.json").read_text())
    assert results["num_samples"] == 6
    assert logged["cococon/vqa/C_1"] == pytest.approx(results["vqa"]["C_k"]["1"])
    assert "cococon/t2i/rho" in logged and "cococon/localization/acc@1" in logged
    table = (run_dir / "tables" / "cococon_samples.jsonl").read_text().splitlines()
    assert len(table) == 3 and "vqa_consistent" in json.loads(table[0])


def test_real_file_subset_with_tiny_ofa(shared_data, tiny_world_model, tmp_path):
    """The random-init tiny OFA scores real CocoCon text and boxes on placeholder images. Its
    ShapesWorld tokenizer cannot encode COCO images, so T2I uses a tiny random VQGAN tokenizer."""
    from diffusers import VQModel

    from unicon.models import load_model
    from unicon.models.vqgan import VQGANTokenizer

    src = shared_data / "cococon" / "cococon.json"
    raw = json.loads(src.read_text())
    chosen = [a for a in raw["annotations"] if "detection" in a][:6] + raw["annotations"][:6]
    sizes = {im["id"]: im for im in raw["images"]}
    for a in chosen:
        im = sizes[a["image_id"]]
        Image.new("RGB", (im["width"], im["height"]), (120, 60, 200)).save(tmp_path / im["file_name"])
    data = load_cococon(src, images_root=tmp_path, skip_missing=True)
    wanted = {a["id"] for a in chosen}
    assert {s.id for s in data} >= wanted
    assert len(data) + len(data.report.missing_images) == 1500

    model = load_model(ckpt := tiny_world_model[1])
    assert Path(ckpt).is_dir()
    torch.manual_seed(0)
    vq = VQModel(down_block_types=("DownEncoderBlock2D",) * 5, up_block_types=("UpDecoderBlock2D",) * 5,
                 block_out_channels=(8,) * 5, layers_per_block=1, latent_channels=4,
                 num_vq_embeddings=model.image_tokenizer.codebook_size, vq_embed_dim=4, norm_num_groups=4,
                 sample_size=64)
    model.image_tokenizer = VQGANTokenizer(vq, image_size=64)
    samples = [s for s in data if s.id in wanted]
    result = runner.evaluate_model(model, samples, batch_size=6, generative=False)
    r = result.results
    assert r["num_samples"] == len(samples) and r["localization"]["n_k"][1] == 6
    for task in metrics.TASKS:
        assert r[task]["n_k"][1] > 0 and r[task]["rho_n"] + r[task]["rho_undefined"] > 0
    check_against_reference(json.loads(json.dumps(jsonsafe.finite(r))), json.loads(json.dumps(result.per_sample)))


def test_t2i_scene_match_counts_exact_renders(tiny_world_model):
    """A double whose T2I renders the gold scene for half of the prompts: scene match = 50 %."""
    from unicon.worlds.shapes import Scene, load_world, render

    world_root = tiny_world_model[0]
    cfg = load_world(world_root).config
    data = load_cococon(world_root / "cococon_test.json").subset(8)
    scenes = {runner.normalize_text(s.caption): s.scene for s in data}

    class RenderingModel(standins.FakeModel):
        def generate_image(self, prompts, context=None, config=None):
            return [render(Scene.from_dict(scenes[p]), cfg) if i % 2 == 0 else Image.new("RGB", (64, 64))
                    for i, p in enumerate(prompts)]

    result = runner.evaluate_model(RenderingModel(), data.samples, batch_size=8, world_root=world_root,
                               tasks=["t2i"], cider_tokenizer="simple")
    assert result.results["generative"]["t2i_scene_match"] == pytest.approx(50.0)
    assert "vqa" not in result.results and result.per_sample[0]["nll"]["vqa"] is None
