"""RealUnify (``unicon evaluate realunify``): the paper's prompts verbatim, the data loaders (the
public release's parquet layout, malformed rows), the strict letter grammar, the metric equations and
their shard merge, the exact judge, and the runner end to end (a test double and a tiny OFA)."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import standins
from unicon.cli import main as unicon_main
from unicon.errors import UserError
from unicon.evaluation.realunify import prompts
from unicon.evaluation.realunify.data import load_instances, parse_options, strip_prompt, subset
from unicon.evaluation.realunify.judges import ExactPollJudge, parse_choice, parse_yes_no
from unicon.evaluation.realunify.metrics import RealUnifyMetric, compute_metrics
from unicon.evaluation.realunify.runner import evaluate_realunify
from unicon.models.base import Scores, TextGeneration
from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, render

CFG = WorldConfig()


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------
def test_prompts_match_the_paper_tables_7_to_13(shared_dir):
    paper = shared_dir / "papers" / "realunify-supplementary.txt"
    if not paper.is_file():
        pytest.skip(f"needs the RealUnify supplementary text {paper}")
    text = paper.read_text()
    for n, template in prompts.TABLES.items():
        m = re.search(rf"Table {n}\. \*\*[^\n]*\*\*\n\n(.*?)(?=\n\nTable \d+\. |\n\n\n)", text, re.S)
        assert m, f"Table {n} not found"
        assert template == m.group(1), f"Table {n} differs from the paper"


def test_prompt_filling():
    assert prompts.polling_prompt("Is there [a] cat?") == (
        "Please answer the following question based on the image:\nQuestion: Is there [a] cat?\n\n"
        "You should only reply yes or no, and do not provide any other extra content.")
    mc = prompts.multiple_choice_prompt("Where is the [Option A]?", ["top left", "top right", "bottom", "none"])
    assert mc.startswith("Select the best answer") and "Question: Where is the [Option A]?\nOption:\nA. top left\n" in mc
    assert mc.endswith("D. none\nThe best answer is:")
    assert prompts.refine_prompt("two cats").startswith("Here is the prompt for image generation: two cats\n\n")
    assert prompts.edit_prompt("mental_reconstruction", "ignored").startswith("Please restore the image")
    assert prompts.edit_prompt("cognitive_navigation", "Which way?") == (
        "Here is the question: Which way?\n\nPlease mark the path(s) in the image that are relevant to the question.")
    with pytest.raises(ValueError, match="no stepwise edit prompt"):
        prompts.edit_prompt("world_knowledge", "q")


# ---------------------------------------------------------------------------------------------
# multiple-choice grammar and yes/no
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply,letter", [
    ("A", "A"), (" b. ", "B"), ("(C)", "C"), ("D)", "D"), ("C.\n", "C"), ("The best answer is: A", "A"),
    ("The best answer is B.", "B"), ("the correct answer is (d)", "D"), ("Answer: (B).", "B"), ("Option: c", "C"),
    ("A. a red circle", None), ("A or B", None), ("", None), ("Because", None), ("E", None), ("AB", None),
    ("The best answer is", None), ("I think A", None), (None, None),
])
def test_multiple_choice_grammar(reply, letter):
    assert parse_choice(reply) == letter


@pytest.mark.parametrize("reply,status", [("Yes", "yes"), (" no. ", "no"), ('"YES"', "yes"), ("No!", "no"),
                                          ("I do not know", "unparseable"), ("yes, it is", "unparseable"), ("", "unparseable")])
def test_yes_no_is_strict(reply, status):
    assert parse_yes_no(reply) == status


# ---------------------------------------------------------------------------------------------
# data: the public release's parquet layout, the documented UEG JSONL, a ShapesWorld root
# ---------------------------------------------------------------------------------------------
def _png(scene: Scene) -> bytes:
    buf = io.BytesIO()
    render(scene, CFG, seed=0).save(buf, format="PNG")
    return buf.getvalue()


SCENE = Scene((ShapeObject("circle", "red", 0, 0), ShapeObject("square", "blue", 1, 2)))
OTHER = Scene((ShapeObject("circle", "red", 0, 1),))


def _release_row(i: int, answer: str = "B", task: str = "Mental Tracking") -> dict:
    question = f"Where does the red circle end after move {i}?"
    options = ["top left", "top right", "bottom left", "bottom right"]
    prompt = prompts.multiple_choice_prompt(question, options)
    return {"index": i, "image": {"bytes": _png(SCENE), "path": f"{i}.png"}, "evaluation_prompt": prompt,
            "question": question, "answer": answer, "task_type": task}


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_in_the_release_layout_reads_back(tmp_path):
    f = _write_parquet(tmp_path / "realunify_mental_tracking.parquet", [_release_row(0), _release_row(1, "D")])
    insts = load_instances(f)
    assert [(i.id, i.category, i.answer, i.axis) for i in insts] == [("0", "mental_tracking", "B", "geu"),
                                                                      ("1", "mental_tracking", "D", "geu")]
    assert insts[0].options == ["top left", "top right", "bottom left", "bottom right"]
    assert insts[0].question == "Where does the red circle end after move 0?"
    assert list(insts[0].image().getdata()) == list(render(SCENE, CFG, seed=0).convert("RGB").getdata())
    # without a question column, the question is the prompt without its options and boilerplate
    row = _release_row(2)
    del row["question"]
    (tmp_path / "more").mkdir()
    _write_parquet(tmp_path / "more" / "b.parquet", [row])
    assert load_instances(tmp_path / "more")[0].question == "Where does the red circle end after move 2?"
    assert len(load_instances(tmp_path)) == 3  # a folder: every parquet file below it


def test_option_parsing_forms():
    assert parse_options("Q?\n(A) x\n(B) y\n(C) z\n(D) w") == ["x", "y", "z", "w"]
    assert parse_options("Q?\nA) x\nB) y\nC: z\nD. w") == ["x", "y", "z", "w"]
    assert parse_options("Q?\nA. x\nB. y\nD. w") is None
    assert strip_prompt("Question: Which?\nOptions:\nA. x\nB. y\nC. z\nD. w\nThe best answer is:") == "Which?"


@pytest.mark.parametrize("change,message", [
    (lambda r: r.pop("answer"), "row 1: missing column.s. answer"),
    (lambda r: r.pop("evaluation_prompt"), "row 1: missing column.s. evaluation_prompt"),
    (lambda r: r.update(image={"bytes": b"not an image", "path": "x.png"}), "row 1: the image bytes do not decode"),
    (lambda r: r.update(answer="E"), "row 1: answer 'E' is not one of the letters A, B, C, D"),
    (lambda r: r.update(evaluation_prompt="Which?\nA. x\nB. y"), "row 1: column 'evaluation_prompt' does not hold the four"),
    (lambda r: r.update(task_type="world knowledge"), "row 1: task_type 'world knowledge' is not a GEU category"),
])
def test_malformed_parquet_rows_name_file_and_row(tmp_path, change, message):
    bad = _release_row(1)
    change(bad)
    good = _release_row(0)
    if "answer" not in bad:
        good.pop("answer")  # one schema for the file: the column is absent
        good["answer"] = "B"
    f = _write_parquet(tmp_path / "geu.parquet", [good, bad])
    with pytest.raises(UserError, match=re.escape(str(f)) + ": " + message):
        load_instances(f)


def test_ueg_jsonl_rows_and_their_errors(tmp_path):
    f = tmp_path / "ueg.jsonl"
    rows = [{"id": "a", "category": "World Knowledge", "prompt": "the flag of a country",
             "questions": [{"question": "Is there a flag?", "answer": "yes"}]},
            {"id": "b", "task_type": "code_to_image", "prompt": "print('x')",
             "question_list": [{"question": "Is there an x?", "answer": "no"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    insts = load_instances(f)
    assert [(i.category, i.axis) for i in insts] == [("world_knowledge", "ueg"), ("code_to_image", "ueg")]
    rows[1]["question_list"][0]["answer"] = "maybe"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=re.escape(f"{f}:2: question 0 has answer 'maybe'")):
        load_instances(f)
    f.write_text(json.dumps({"id": "c", "category": "x", "questions": []}) + "\n")
    with pytest.raises(UserError, match=re.escape(f"{f}:1: missing field(s) prompt")):
        load_instances(f)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(UserError, match="expected a ShapesWorld root"):
        load_instances(tmp_path / "x.txt")


def test_unknown_ueg_category_is_refused_naming_file_line_and_the_categories(tmp_path):
    """A UEG category outside the paper's six is refused as GEU refuses its unknown ones (it used to
    become a table row of its own)."""
    f = tmp_path / "ueg.jsonl"
    rows = [{"id": "a", "category": "world_knowledge", "prompt": "a flag",
             "questions": [{"question": "Is there a flag?", "answer": "yes"}]},
            {"id": "b", "category": "Art History", "prompt": "a painting",
             "questions": [{"question": "Is there a painting?", "answer": "yes"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=re.escape(f"{f}:2: category 'Art History' is not a UEG category "
                                                  "(world_knowledge, commonsense_reasoning,")):
        load_instances(f)


def test_duplicate_ids_are_refused_naming_both_rows(tmp_path):
    """Two instances of a category with one id would save their images to one file; refused, naming
    both rows (JSONL lines; parquet rows, also across the files of a folder)."""
    f = tmp_path / "ueg.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (UEG_ROWS[0], UEG_ROWS[1], UEG_ROWS[0])))
    with pytest.raises(UserError, match=re.escape(f"{f}:3: id 'm0' (mathematical_reasoning) repeats {f}:1")):
        load_instances(f)
    p = _write_parquet(tmp_path / "geu.parquet", [_release_row(0), _release_row(1), _release_row(1, "C")])
    with pytest.raises(UserError, match=re.escape(f"{p}: row 2: id '1' (mental_tracking) repeats {p}: row 1")):
        load_instances(p)
    (tmp_path / "folder").mkdir()
    a = _write_parquet(tmp_path / "folder" / "a.parquet", [_release_row(0)])
    b = _write_parquet(tmp_path / "folder" / "b.parquet", [_release_row(0, task="Mental Reconstruction"),
                                                           _release_row(0, "C")])
    with pytest.raises(UserError, match=re.escape(f"{b}: row 1: id '0' (mental_tracking) repeats {a}: row 0")):
        load_instances(tmp_path / "folder")
    # ids that differ but name one image file (``a b`` and ``a_b``) are refused too
    twin = dict(UEG_ROWS[0], id="m 0")
    f.write_text("".join(json.dumps(r) + "\n" for r in (dict(UEG_ROWS[0], id="m_0"), twin)))
    with pytest.raises(UserError, match=re.escape(f"{f}:2: id 'm 0' (mathematical_reasoning) repeats {f}:1 "
                                                  "(id 'm_0')")):
        load_instances(f)
    one = load_instances(a)[0]  # the runner refuses them too, before any model call
    with pytest.raises(UserError, match=re.escape(f"{a}: row 0: id '0' (mental_tracking) repeats {a}: row 0")):
        evaluate_realunify(Double(), [one, one], judge=None, settings=["direct"])


def test_empty_data_files_are_refused_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "ueg.jsonl"
    f.write_text("\n")
    with pytest.raises(UserError, match=re.escape(f"{f}: holds no rows")):
        load_instances(f)
    p = tmp_path / "geu.parquet"
    pq.write_table(pa.Table.from_pylist([_release_row(0)]).slice(0, 0), p)
    with pytest.raises(UserError, match=re.escape(f"{p}: holds no rows")):
        load_instances(p)
    world = _world_data(tmp_path / "world")
    (world / "realunify" / "geu.jsonl").write_text("")
    with pytest.raises(UserError, match=re.escape(f"{world / 'realunify' / 'geu.jsonl'}: holds no rows")):
        load_instances(world)


# ---------------------------------------------------------------------------------------------
# a ShapesWorld root with realunify files, written by hand in the documented layout
# ---------------------------------------------------------------------------------------------
def _count(color, shape, n):
    return {"op": "count", "where": {"color": color, "shape": shape}, "cmp": "eq", "n": n}


UEG_ROWS = [
    {"id": "m0", "category": "mathematical_reasoning", "prompt": "as many red circles as one times one",
     "questions": [{"question": "Is there exactly one red circle?", "answer": "yes", "check": _count("red", "circle", 1)},
                   {"question": "Is there a blue square?", "answer": "yes",
                    "check": {"op": "exists", "where": {"color": "blue", "shape": "square"}}}]},
    {"id": "l0", "category": "logical_reasoning", "prompt": "one red circle and nothing blue",
     "questions": [{"question": "Is there exactly one red circle?", "answer": "yes", "check": _count("red", "circle", 1)},
                   {"question": "Is anything blue?", "answer": "no", "check": {"op": "exists", "where": {"color": "blue"}}}]},
]


def _world_data(root: Path, world_json: Path | None = None) -> Path:
    """``root`` as a ShapesWorld root holding realunify/ueg.jsonl and geu.jsonl (two GEU rows: the
    first one's target scene is its own image's, the second's another)."""
    root.mkdir(parents=True, exist_ok=True)
    if world_json is not None:
        shutil.copy(world_json, root / "world.json")
    else:
        (root / "world.json").write_text(json.dumps({"config": CFG.to_dict()}))
    ru = root / "realunify"
    (ru / "images").mkdir(parents=True)
    render(SCENE, CFG, seed=0).save(ru / "images" / "g0.png")
    (ru / "ueg.jsonl").write_text("".join(json.dumps(r) + "\n" for r in UEG_ROWS))
    geu = [{"id": f"g{k}", "category": cat, "image": "realunify/images/g0.png", "question": f"Where is it {k}?",
            "options": ["w", "x", "y", "z"], "answer": answer, "target_scene": target.to_dict(),
            "edit_instruction": f"move it {k}"}
           for k, (cat, answer, target) in enumerate([("mental_tracking", "A", SCENE),
                                                      ("cognitive_navigation", "B", OTHER)])]
    (ru / "geu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in geu))
    return root


class Double(standins.FakeModel):
    """Draws ``SCENE`` for prompts naming "blue square" or "times", a red circle alone otherwise; the
    refined prompt (Table 9) of every prompt is "a red circle alone"; answers "A"; edits are the
    identity (when ``editing``)."""

    def __init__(self, editing: bool = False, **kw):
        super().__init__(**{"answers": ["A"], **kw})
        self.supports_editing = editing

    def generate_image(self, prompts, context=None, config=None):
        self._call("generate_image", len(prompts))
        return [render(SCENE if "times" in p else OTHER, CFG, seed=0) for p in prompts]

    def reason(self, prompts, max_new_tokens=256):
        self._call("reason", len(prompts))
        assert all(p.startswith("Here is the prompt for image generation: ") for p in prompts)
        return [TextGeneration('"a red circle alone"', False, 4) for _ in prompts]

    def edit_image(self, images, instructions, config=None):
        self._call("edit_image", len(images))
        return [im.copy() for im in images]


def test_exact_judge_scores_per_question_and_per_instance():
    from unicon.evaluation.realunify.data import ueg_from_row

    insts = [ueg_from_row(r, f"row {i}") for i, r in enumerate(UEG_ROWS)]
    scene_image = render(SCENE, CFG, seed=0)
    v = ExactPollJudge(CFG).judge(insts, [scene_image, scene_image])
    assert v[0].statuses == ["yes", "yes"] and all(v[0].correct(insts[0].questions))
    assert v[1].statuses == ["yes", "yes"] and v[1].correct(insts[1].questions) == [True, False]
    none = ExactPollJudge(CFG).judge(insts, [Image.new("RGB", (64, 64), (3, 200, 77)), None])
    assert none[0].statuses == ["no_scene"] * 2 and none[1].statuses == ["no_input"] * 2


def test_runner_with_a_test_double_scores_both_settings(tmp_path):
    data = _world_data(tmp_path / "world")
    insts = load_instances(data)
    metrics, samples = evaluate_realunify(Double(editing=True), insts, ExactPollJudge(CFG), out_dir=tmp_path / "out",
                                          batch_size=3, world_cfg=CFG)
    # UEG direct: m0 draws SCENE (right), l0 draws OTHER (right: one red circle, nothing blue);
    # stepwise: both draw OTHER from the refined prompt: m0 misses the blue square, l0 right
    assert metrics["acc_direct/mathematical_reasoning"] == 100.0 and metrics["acc_stepwise/mathematical_reasoning"] == 0.0
    assert metrics["q_acc_stepwise/mathematical_reasoning"] == 50.0 and metrics["acc_stepwise/logical_reasoning"] == 100.0
    assert metrics["acc_direct/ueg"] == 100.0 and metrics["acc_stepwise/ueg"] == 50.0 and metrics["delta/ueg"] == -50.0
    # GEU: the double answers "A" (g0 right, g1 wrong) on the input and on the edited image
    assert metrics["acc_direct/geu"] == metrics["acc_stepwise/geu"] == 50.0 and metrics["delta/geu"] == 0.0
    # identity edits: g0's target is its own image, g1's is not
    assert metrics["edit_acc/mental_tracking"] == 100.0 and metrics["edit_acc/cognitive_navigation"] == 0.0
    assert metrics["edit_acc"] == 50.0
    assert metrics["acc_direct"] == 75.0 and metrics["acc_stepwise"] == 50.0 and metrics["delta"] == -25.0
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["m0", "l0", "g0", "g1"]
    assert rows[0]["refined_prompt"] == "a red circle alone" and rows[0]["statuses_stepwise"] == ["yes", "no"]
    assert rows[2]["edit_instruction"] == prompts.edit_prompt("mental_tracking", "Where is it 0?")
    for r in rows:  # UEG: the two drawings; GEU: the input image and the edited one
        for key in ("image_direct", "image_stepwise") if r["axis"] == "ueg" else ("image", "image_stepwise"):
            assert (tmp_path / "out" / r[key]).is_file()
    assert compute_metrics(rows) == metrics
    saved = json.loads((tmp_path / "out" / "realunify.json").read_text())
    assert saved["metrics"] == metrics and saved["settings"] == ["direct", "stepwise"] and saved["judge"] == "exact"
    assert "| GEU | **GEU** | 2 | 50.0 | 50.0 | +0.0 |" in (tmp_path / "out" / "table.md").read_text()
    # --edit-prompt row: the rows' own instructions
    _, samples = evaluate_realunify(Double(editing=True), insts[2:], ExactPollJudge(CFG), settings=["stepwise"],
                                    edit_prompt_source="row", world_cfg=CFG)
    assert [s.edit_instruction for s in samples] == ["move it 0", "move it 1"]


class OptionScorer(Double):
    """Scores an option text by its length in characters (mean NLL 0.1 per character), except
    ``cheap`` (NLL 0); records the prompts it scored after."""

    def __init__(self, cheap: str, **kw):
        super().__init__(editing=True, **kw)
        self.cheap, self.scored_prompts = cheap, []

    def score_text(self, images, prompts, candidates):
        self.scored_prompts += list(prompts)
        rows = [[0.0 if c == self.cheap else 0.1 * len(c) for c in cands] for cands in candidates]
        width = max(map(len, rows))
        nll = torch.tensor([r + [0.0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[k < len(r) for k in range(width)] for r in rows])
        return Scores(nll=nll, sum_nll=nll * 7, mask=mask, num_tokens=mask.long() * 7)


def test_likelihood_answer_mode_picks_the_likeliest_option_after_the_bare_question(tmp_path):
    insts = load_instances(_world_data(tmp_path / "world"))[2:]  # g0 (answer A), g1 (answer B); options w x y z
    model = OptionScorer(cheap="x")
    metrics, samples = evaluate_realunify(model, insts, ExactPollJudge(CFG), settings=["direct", "stepwise"],
                                          answer_mode="likelihood", world_cfg=CFG)
    # "x" is option B for both: g0 wrong, g1 right, in both settings (the edit is the identity)
    assert [s.preds["direct"] for s in samples] == [s.preds["stepwise"] for s in samples] == ["B", "B"]
    assert metrics["acc_direct/geu"] == metrics["acc_stepwise/geu"] == 50.0
    assert model.scored_prompts == [i.question for i in insts] * 2  # the bare question, never Table 8
    assert not any(c[0] == "answer" for c in model.calls)  # nothing generated as text
    with pytest.raises(UserError, match="answer_mode"):
        evaluate_realunify(model, insts, ExactPollJudge(CFG), settings=["direct"], answer_mode="logits")


def test_geu_stepwise_on_a_model_without_editing_is_refused_before_any_generation(tmp_path):
    insts = load_instances(_world_data(tmp_path / "world"))
    model = Double(editing=False)
    with pytest.raises(UserError, match="backend 'fake' does not edit images"):
        evaluate_realunify(model, insts, ExactPollJudge(CFG), settings=["direct", "stepwise"])
    assert model.calls == []
    # UEG-only data, or direct only, runs
    evaluate_realunify(model, insts[:2], ExactPollJudge(CFG), settings=["direct", "stepwise"])
    metrics, _ = evaluate_realunify(model, insts, ExactPollJudge(CFG), settings=["direct"])
    assert "acc_stepwise" not in metrics and "delta" not in metrics and metrics["acc_direct"] == 75.0


# ---------------------------------------------------------------------------------------------
# metrics by hand, shard merge
# ---------------------------------------------------------------------------------------------
def _ueg(i, cat, direct, stepwise, answers=("yes", "no")):
    qs = [{"question": f"q{k}", "answer": a} for k, a in enumerate(answers)]
    return {"id": i, "axis": "ueg", "category": cat, "questions": qs, "refined_prompt": "r",
            "statuses_direct": list(direct), "correct_direct": list(direct) == list(answers), "image_error_direct": None,
            "statuses_stepwise": list(stepwise), "correct_stepwise": list(stepwise) == list(answers),
            "image_error_stepwise": None if stepwise[0] != "no_input" else "failed"}


def _geu(i, cat, direct, stepwise, answer="A", edit=None):
    return {"id": i, "axis": "geu", "category": cat, "answer": answer, "pred_direct": direct,
            "correct_direct": direct == answer, "image_error_direct": None, "pred_stepwise": stepwise,
            "correct_stepwise": stepwise == answer, "image_error_stepwise": None, "edit_match": edit}


RECORDS = [
    _ueg(1, "logical_reasoning", ("yes", "no"), ("yes", "yes")),             # direct right; stepwise 1 of 2 questions
    {**_ueg(2, "logical_reasoning", ("unparseable", "no"), ("yes", "no")),   # stepwise right, its refinement cut
     "refined_truncated": True},
    _ueg(3, "code_to_image", ("no_scene", "no_scene"), ("no_input", "no_input")),
    _geu(4, "mental_tracking", "A", "A", edit=True),
    _geu(5, "mental_tracking", None, "B", edit=False),                       # direct unparseable
    _geu(6, "attentional_focusing", "A", None),                              # stepwise unparseable, no target scene
]


def test_metric_equations_on_hand_made_records():
    m = compute_metrics(RECORDS)
    assert m["acc_direct/logical_reasoning"] == 50.0 and m["acc_stepwise/logical_reasoning"] == 50.0
    assert m["q_acc_direct/logical_reasoning"] == 75.0 and m["q_acc_stepwise/logical_reasoning"] == 75.0
    assert m["acc_direct/ueg"] == pytest.approx(100 / 3) and m["q_acc_direct/ueg"] == 50.0
    assert m["acc_direct/mental_tracking"] == 50.0 and m["acc_stepwise/mental_tracking"] == 50.0
    assert m["acc_direct/geu"] == pytest.approx(200 / 3) and m["acc_stepwise/geu"] == pytest.approx(100 / 3)
    assert m["acc_direct"] == 50.0 and m["acc_stepwise"] == pytest.approx(100 / 3)
    assert m["delta"] == pytest.approx(100 / 3 - 50) and m["delta/attentional_focusing"] == -100.0
    assert m["edit_acc"] == 50.0 and m["edit_n"] == 2 and "edit_acc/attentional_focusing" not in m
    assert (m["unparseable_direct/ueg"], m["unparseable_direct/geu"], m["unparseable_stepwise/geu"]) == (1, 1, 1)
    assert m["no_scene_direct"] == 1 and m["missing_stepwise"] == 1 and m["missing_direct"] == 0
    assert "q_acc_direct/mental_tracking" not in m and m["n"] == 6 and m["n/code_to_image"] == 1
    assert m["truncated_refined"] == 1 and m["empty_refined"] == 0  # counted, never silent
    from unicon.evaluation.realunify.metrics import markdown_table

    assert "refined prompts cut at the token budget (stepwise UEG) 1" in markdown_table(m)


def test_shard_states_merged_equal_the_unsharded_metrics():
    cats = ["logical_reasoning", "code_to_image", "mental_tracking", "attentional_focusing"]
    shards = [RealUnifyMetric(cats), RealUnifyMetric(cats)]
    shards[0].update(RECORDS[0::2])
    shards[1].update(RECORDS[1::2])
    shards[0].merge_state(shards[1])
    assert shards[0].compute() == compute_metrics(RECORDS, cats)
    with pytest.raises(ValueError, match="category 'world_knowledge'"):
        RealUnifyMetric(cats).update([_ueg(7, "world_knowledge", ("yes", "no"), ("yes", "no"))])


# ---------------------------------------------------------------------------------------------
# the command: results file, refusal, --shard/--merge, and the callback's config
# ---------------------------------------------------------------------------------------------
def test_cli_writes_results_refuses_stepwise_without_editing_and_merges_shards(tmp_path, capsys, monkeypatch):
    from unicon.core import weights_fingerprint

    monkeypatch.setattr(standins.FakeModel, "supports_editing", False)  # a backend that cannot edit

    data = _world_data(tmp_path / "world")
    ckpt = tmp_path / "ckpt"
    model = standins.FakeModel(answers=["A", "B"], draw="world", world=str(data))
    model.save_pretrained(str(ckpt))
    common = ["evaluate", "realunify", "--ckpt", str(ckpt), "--data", str(data), "--device", "cpu", "--logger", "none",
              "--image-seed", "3"]
    assert unicon_main([*common, "--out", str(tmp_path / "refused")]) == 2
    assert "backend 'fake' does not edit images" in capsys.readouterr().err
    quick = ["--settings", "direct", "--batch-size", "2"]
    assert unicon_main([*common, *quick, "--out", str(tmp_path / "one")]) == 0
    printed = capsys.readouterr().out
    assert "| **overall** |" in printed and "realunify.json" in printed
    one = json.loads((tmp_path / "one" / "realunify.json").read_text())
    assert one["model_fingerprint"] == weights_fingerprint(model) and one["settings"] == ["direct"]
    assert one["generation"]["image"]["seed"] == 3 and len(one["metrics"]) > 5
    for part in ("0/2", "1/2"):
        assert unicon_main([*common, *quick, "--out", str(tmp_path / "split"), "--shard", part]) == 0
    assert unicon_main([*common, *quick, "--out", str(tmp_path / "split"), "--merge"]) == 0
    for name in ("samples.jsonl", "table.md"):
        assert (tmp_path / "split" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    assert json.loads((tmp_path / "split" / "realunify.json").read_text())["metrics"] == one["metrics"]
    for run in ("one", "split"):
        standins.assert_strict_json(tmp_path / run)  # results, samples, tables, metrics: no NaN / Infinity
    assert unicon_main([*common, "--settings", "", "--out", str(tmp_path / "none")]) == 2
    assert unicon_main([*common, "--judge", "vlm:/nonexistent", "--out", str(tmp_path / "none")]) == 2


def test_cli_refuses_an_out_of_another_run_unless_overwrite_deletes_it(tmp_path, capsys, monkeypatch):
    """A rerun into an ``--out`` that another run wrote (other data, other weights) is refused before
    anything is written; ``--overwrite`` deletes the old outputs first, so no file mixes the two runs;
    the same command again is the same run."""
    monkeypatch.setattr(standins.FakeModel, "supports_editing", False)
    first, second = _world_data(tmp_path / "first"), _world_data(tmp_path / "second")
    (second / "realunify" / "ueg.jsonl").write_text(json.dumps(UEG_ROWS[0]) + "\n")  # other data: one UEG row
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    standins.FakeModel(answers=["A", "B"], draw="world", world=str(first)).save_pretrained(str(ckpt))
    common = ["evaluate", "realunify", "--ckpt", str(ckpt), "--device", "cpu", "--logger", "csv",
              "--settings", "direct", "--batch-size", "2", "--out", str(out)]
    assert unicon_main([*common, "--data", str(first)]) == 0
    capsys.readouterr()
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert {Path("realunify.json"), Path("metrics.jsonl"), Path("tables/realunify_samples.jsonl")} <= set(before)

    assert unicon_main([*common, "--data", str(second)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--out {out} holds the outputs of another run" in err, err
    assert f'data="{first}" (this run: "{second}")' in err and "--overwrite" in err, err
    standins.FakeModel(scale=0.5, answers=["A", "B"], draw="world", world=str(first)).save_pretrained(str(ckpt))
    assert unicon_main([*common, "--data", str(first)]) == 2  # the same settings, other weights
    err = capsys.readouterr().err.strip()
    assert "written by another model" in err and err.count("\n") == 0, err
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before

    assert unicon_main([*common, "--data", str(second), "--overwrite"]) == 0
    assert "--overwrite: deleting the outputs of another run" in capsys.readouterr().out
    assert json.loads((out / "realunify.json").read_text())["data"] == str(second)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # this run's row only
    rows = [json.loads(line) for line in (out / "tables" / "realunify_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 1 + 2  # one UEG and two GEU instances: none of the first run's rows
    images = [p.relative_to(out) for p in out.rglob("*.png")]
    assert any("l0" in str(p) for p in before) and not any("l0" in str(p) for p in images)  # the first run's only
    assert unicon_main([*common, "--data", str(second)]) == 0  # the same run again: its rows replaced, not added
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert len((out / "csv" / "metrics.csv").read_text().splitlines()) == 1 + 1  # the header and the step-0 row
    assert len((out / "tables" / "realunify_samples.jsonl").read_text().splitlines()) == 1 + 2
    owner = json.loads((out / "evaluate-run.json").read_text())
    assert owner["command"] == "unicon evaluate realunify" and owner["settings"]["data"] == str(second)


def test_eval_group_and_callback_from_config(tmp_path):
    from unicon import config
    from unicon.evaluation import suites
    from unicon.evaluation.callbacks import SuiteCallback

    data = _world_data(tmp_path / "world")
    cfg = config.compose(["eval=realunify", f"data.root={data}", "eval.realunify.settings=[direct]"])
    assert cfg.eval.realunify.enabled and not cfg.eval.shapes.enabled
    argv = suites.suite("realunify").argv(cfg)
    assert argv[:1] == [f"--data={data}"] and "--settings=direct" in argv and "--limit=4" in argv
    cb = SuiteCallback.from_config(suites.suite("realunify"), cfg)
    assert cb.inputs.settings == ["direct"] and len(cb.inputs.instances) == 4
    cb.setup(None, Double(editing=False), "fit")  # direct only: nothing to refuse
    stepwise = SuiteCallback(suites.suite("realunify"),
                             config.RealUnifyEvalConfig(data=str(data), settings=["direct", "stepwise"]))
    with pytest.raises(UserError, match="does not edit images"):
        stepwise.setup(None, Double(editing=False), "fit")
    assert not config.compose([]).eval.realunify.enabled


# ---------------------------------------------------------------------------------------------
# a tiny OFA (randomly initialised) through the runner
# ---------------------------------------------------------------------------------------------
def test_tiny_ofa_end_to_end(tiny_shapes_world, tmp_path):
    from unicon.models import build_model
    from unicon.evaluation.realunify.judges import edit_matches
    from unicon.worlds.shapes import NotAShapesWorldImage, load_world, parse
    from unicon.worlds.shapes_realunify import answer_poll

    torch.manual_seed(0)
    model = build_model({"backend": "ofa", "preset": "shapes-tiny",
                         "arch": {"num_bins": 65, "max_source_length": 96, "max_target_length": 16, "num_beams": 1,
                                  "max_new_tokens": 8, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
                                  "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                                  "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}}, tiny_shapes_world)
    data = _world_data(tmp_path / "world", tiny_shapes_world / "world.json")
    cfg = load_world(data).config
    insts = load_instances(data)
    judge = ExactPollJudge(cfg)
    out = tmp_path / "out"
    metrics, _ = evaluate_realunify(model, insts, judge, out_dir=out, settings=["direct"], max_new_tokens=8,
                                    batch_size=4, world_cfg=cfg)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for r in rows[:2]:  # UEG verdicts re-checked from the saved PNGs
        image = Image.open(out / r["image_direct"])
        try:
            scene = parse(image, cfg)
            want = [answer_poll(q, scene, cfg) for q in next(u for u in UEG_ROWS if u["id"] == r["id"])["questions"]]
        except NotAShapesWorldImage:
            want = ["no_scene"] * 2
        assert r["statuses_direct"] == want
    for r in rows[2:]:
        assert r["correct_direct"] == (parse_choice(r["reply_direct"]) == r["answer"])
    assert metrics["acc_direct"] == pytest.approx(100 * sum(r["correct_direct"] for r in rows) / 4)
    if not getattr(model, "supports_editing", False):
        with pytest.raises(UserError, match="backend 'ofa'"):
            evaluate_realunify(model, insts, judge, settings=["direct", "stepwise"])
        pytest.skip(f"the {model.backend} backend does not edit images (supports_editing is False): "
                    "GEU stepwise is refused, as asserted above")
    metrics, _ = evaluate_realunify(model, insts, judge, out_dir=tmp_path / "both", max_new_tokens=8, batch_size=4,
                                    world_cfg=cfg)
    rows = [json.loads(line) for line in (tmp_path / "both" / "samples.jsonl").read_text().splitlines()]
    for r in rows[2:]:
        edited = Image.open(tmp_path / "both" / r["image_stepwise"]) if r["image_stepwise"] else None
        assert r["edit_match"] == edit_matches(edited, {"g0": SCENE, "g1": OTHER}[r["id"]].to_dict(), cfg)
    assert {"acc_stepwise", "delta", "edit_acc"} <= set(metrics)



# ---------------------------------------------------------------------------------------------
# GEU letter reading: strict (ours) or lenient (the authors' scorer)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply,strict,lenient", [
    ("A", "A", "A"), ("A. a red circle", None, "A"), ("Because it is red", None, "B"),
    ("Answer: B", "B", "B"),  # "Answer" is deleted first, or its capital A would be read
    ("Best answer: C", None, "C"), ("The best answer is D", "D", "D"), ("I think it is a Circle", None, "C"),
    ("b", "B", None), ("", None, None), (None, None, None), ("none of them", None, None),
])
def test_lenient_letter_reading_is_the_authors_scorer(reply, strict, lenient):
    from unicon.evaluation.realunify.judges import parse_choice_lenient

    assert parse_choice(reply) == strict
    assert parse_choice_lenient(reply) == lenient


def test_letter_parse_changes_the_score_and_is_recorded(tmp_path):
    insts = load_instances(_world_data(tmp_path / "world"))[2:]  # g0 (answer A), g1 (answer B)
    got = {}
    for mode in ("strict", "lenient"):
        out = tmp_path / mode
        metrics, samples = evaluate_realunify(Double(answers=["A. w"]), insts, ExactPollJudge(CFG), out_dir=out,
                                              settings=["direct"], letter_parse=mode, world_cfg=CFG)
        got[mode] = (metrics["acc_direct/geu"], metrics["unparseable_direct/geu"], [s.preds["direct"] for s in samples])
        assert json.loads((out / "realunify.json").read_text())["letter_parse"] == mode
    assert got == {"strict": (0.0, 2.0, [None, None]), "lenient": (50.0, 0.0, ["A", "A"])}
    with pytest.raises(UserError, match="letter_parse"):
        evaluate_realunify(Double(), insts, ExactPollJudge(CFG), settings=["direct"], letter_parse="loose")


# ---------------------------------------------------------------------------------------------
# GEU stepwise input: the edited image alone, or the original and the edited one (the release)
# ---------------------------------------------------------------------------------------------
class TwoImageDouble(Double):
    """:class:`Double` that edits every image into ``OTHER`` (so the edited image differs from the
    input) and takes several images per question: ``answer_images`` replies "B" and records the
    images and prompts it got; ``answer`` replies "A" and records its questions."""

    supports_multi_image = True

    def __init__(self, **kw):
        super().__init__(editing=True, **kw)
        self.multi: list[tuple[list[list[Image.Image]], list[str]]] = []
        self.single: list[str] = []

    def edit_image(self, images, instructions, config=None):
        self._call("edit_image", len(images))
        return [render(OTHER, CFG, seed=0) for _ in images]

    def answer(self, images, questions, **kw):
        self.single += list(questions)
        return super().answer(images, questions, **kw)

    def answer_images(self, images, questions, **kw):
        self._call("answer_images", len(questions))
        self.multi.append(([list(row) for row in images], list(questions)))
        return ["B" for _ in questions]


def _pixels(image: Image.Image) -> list:
    return list(image.convert("RGB").getdata())


def test_two_image_prompt_is_the_release_sentence_then_table_8():
    q, opts = "Where does the red circle end?", ["w", "x", "y", "z"]
    got = prompts.two_image_prompt("mental_tracking", q, opts)
    assert got == ("In addition to the original image, you are also given a transformed version of the image with "
                   "the modifications applied according to the question.\n\n" + prompts.multiple_choice_prompt(q, opts))
    assert set(prompts.TWO_IMAGE_NOTES) == set(prompts.EDIT_TABLES)  # every GEU category has its sentence
    with pytest.raises(ValueError, match="no two-image note"):
        prompts.two_image_prompt("world_knowledge", q, opts)


def test_stepwise_input_auto_resolves_by_the_rows_origin(tmp_path):
    from unicon.evaluation.realunify.runner import resolve_stepwise_input

    world = load_instances(_world_data(tmp_path / "world"))
    release = load_instances(_write_parquet(tmp_path / "mt.parquet", [_release_row(0)]))
    assert resolve_stepwise_input("auto", world) == "edited"  # ShapesWorld: the stepwise wording needs no original
    assert resolve_stepwise_input("auto", release) == "original+edited"  # the release's runner
    assert resolve_stepwise_input("auto", world[:2]) is None  # UEG only: no GEU row to answer
    assert resolve_stepwise_input("original+edited", world) == "original+edited"
    assert resolve_stepwise_input("edited", release) == "edited"
    with pytest.raises(UserError, match=r"--stepwise-input.*got 'both'"):
        resolve_stepwise_input("both", world)


def test_original_and_edited_images_reach_a_two_image_model_in_order(tmp_path):
    f = _write_parquet(tmp_path / "mt.parquet", [_release_row(0, "B"), _release_row(1, "A")])
    insts = load_instances(f)
    model = TwoImageDouble()
    out = tmp_path / "out"
    metrics, samples = evaluate_realunify(model, insts, ExactPollJudge(CFG), out_dir=out, batch_size=2)  # auto
    assert json.loads((out / "realunify.json").read_text())["stepwise_input"] == "original+edited"
    [(rows, questions)] = model.multi  # one stepwise batch, both rows
    assert len(rows) == 2 and all(len(r) == 2 for r in rows)
    for (first, second), inst, question in zip(rows, insts, questions):
        assert _pixels(first) == _pixels(inst.image())  # the input image first
        assert _pixels(second) == _pixels(render(OTHER, CFG, seed=0))  # then the edited one
        assert question == prompts.two_image_prompt("mental_tracking", inst.question, inst.options)
        assert question.startswith("In addition to the original image, you are also given")
    assert model.single == [prompts.multiple_choice_prompt(i.question, i.options) for i in insts]  # direct only
    # direct answers "A" (row 1 right), stepwise "B" (row 0 right)
    assert [s.preds["stepwise"] for s in samples] == ["B", "B"] and [s.correct["stepwise"] for s in samples] == [
        True, False]
    assert metrics["acc_direct/geu"] == metrics["acc_stepwise/geu"] == 50.0
    # "edited": the edited image alone, through answer(); answer_images is not called
    model = TwoImageDouble()
    evaluate_realunify(model, insts, ExactPollJudge(CFG), out_dir=tmp_path / "edited", settings=["stepwise"],
                       stepwise_input="edited")
    assert model.multi == [] and len(model.single) == 2
    assert json.loads((tmp_path / "edited" / "realunify.json").read_text())["stepwise_input"] == "edited"


def test_shapesworld_rows_ask_the_stepwise_wording_of_the_edited_image_and_the_direct_one_of_both(tmp_path):
    data = _world_data(tmp_path / "world")
    geu = data / "realunify" / "geu.jsonl"
    rows = [{**json.loads(line), "stepwise_question": f"Where is it now {k}?"}
            for k, line in enumerate(geu.read_text().splitlines())]
    geu.write_text("".join(json.dumps(r) + "\n" for r in rows))
    insts = load_instances(data)[2:]
    model = TwoImageDouble()
    evaluate_realunify(model, insts, ExactPollJudge(CFG), out_dir=tmp_path / "auto", settings=["stepwise"],
                       world_cfg=CFG)
    assert json.loads((tmp_path / "auto" / "realunify.json").read_text())["stepwise_input"] == "edited"
    assert model.multi == [] and model.single == [prompts.multiple_choice_prompt(f"Where is it now {k}?", i.options)
                                                  for k, i in enumerate(insts)]
    model = TwoImageDouble()
    evaluate_realunify(model, insts, ExactPollJudge(CFG), settings=["stepwise"], world_cfg=CFG,
                       stepwise_input="original+edited")
    assert model.single == [] and model.multi[0][1] == [prompts.two_image_prompt(i.category, i.question, i.options)
                                                        for i in insts]


def test_original_and_edited_on_a_one_image_model_is_refused_before_any_generation(tmp_path):
    release = load_instances(_write_parquet(tmp_path / "mt.parquet", [_release_row(0)]))
    world = load_instances(_world_data(tmp_path / "world"))
    model = Double(editing=True)  # edits, one image per question
    for insts, value in ((release, "auto"), (world, "original+edited")):
        with pytest.raises(UserError, match=r"original\+edited .*backend 'fake' takes one image per question"):
            evaluate_realunify(model, insts, ExactPollJudge(CFG), settings=["direct", "stepwise"],
                               stepwise_input=value, world_cfg=CFG)
    two = TwoImageDouble()
    with pytest.raises(UserError, match=r"--stepwise-input original\+edited .*--answer-mode likelihood"):
        evaluate_realunify(two, release, ExactPollJudge(CFG), answer_mode="likelihood")
    assert model.calls == [] and two.calls == []
    # the edited image alone, or direct only, runs on the one-image model
    evaluate_realunify(model, release, ExactPollJudge(CFG), stepwise_input="edited")
    evaluate_realunify(model, release, ExactPollJudge(CFG), settings=["direct"])


def test_cli_stepwise_input_flag_parses_is_recorded_and_refused_on_a_one_image_backend(tmp_path, capsys):
    data = _world_data(tmp_path / "world")
    ckpt = tmp_path / "ckpt"
    standins.FakeModel(answers=["A", "B"], draw="world", world=str(data)).save_pretrained(str(ckpt))
    assert not standins.FakeModel.supports_multi_image and standins.FakeModel.supports_editing
    common = ["evaluate", "realunify", "--ckpt", str(ckpt), "--data", str(data), "--device", "cpu", "--logger", "none",
              "--settings", "stepwise", "--batch-size", "2"]
    for flag, recorded in ((None, "edited"), ("edited", "edited")):
        out = tmp_path / f"run-{flag}"
        assert unicon_main([*common, *(["--stepwise-input", flag] if flag else []), "--out", str(out)]) == 0
        assert json.loads((out / "realunify.json").read_text())["stepwise_input"] == recorded
    capsys.readouterr()
    refused = tmp_path / "refused"
    assert unicon_main([*common, "--stepwise-input", "original+edited", "--out", str(refused)]) == 2
    err = capsys.readouterr().err
    assert "backend 'fake' takes one image per question" in err and "original+edited" in err, err
    assert not (refused / "images").exists() and not (refused / "samples.jsonl").exists()  # nothing generated
    with pytest.raises(SystemExit):
        unicon_main([*common, "--stepwise-input", "both", "--out", str(tmp_path / "bad")])
    assert "--stepwise-input: invalid choice: 'both'" in capsys.readouterr().err


def test_stepwise_input_is_checked_at_compose_time_and_resolved_by_the_callback(tmp_path):
    from unicon import config
    from unicon.evaluation import suites
    from unicon.evaluation.callbacks import SuiteCallback

    data = _world_data(tmp_path / "world")
    bad = r"command line: eval\.realunify\.stepwise_input=.both. is not one of"
    with pytest.raises(config.ConfigError, match=bad):
        config.compose(["eval=realunify", f"data.root={data}", "eval.realunify.stepwise_input=both"])
    cfg = config.compose(["eval=realunify", f"data.root={data}"])
    assert cfg.eval.realunify.stepwise_input == "auto"
    assert "--stepwise-input=auto" in suites.suite("realunify").argv(cfg)
    # a ShapesWorld root
    assert SuiteCallback.from_config(suites.suite("realunify"), cfg).inputs.stepwise_input == "edited"
    cfg = config.compose(["eval=realunify", f"data.root={data}", "eval.realunify.stepwise_input=original+edited"])
    cb = SuiteCallback.from_config(suites.suite("realunify"), cfg)
    with pytest.raises(UserError, match="backend 'fake' takes one image per question"):
        cb.setup(None, Double(editing=True), "fit")
    cb.setup(None, TwoImageDouble(), "fit")
