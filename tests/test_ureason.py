"""UReason: loader, refined-prompt extraction, strict judge parsing, metrics, judges, settings run,
the CLI and callback, and DDP (2 gloo ranks) == 1 process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

import standins
from unicon.config import UReasonEvalConfig
from unicon.data.ureason import (
    CATEGORIES,
    UReasonFormatError,
    UReasonInstance,
    load_instances,
    load_shapes_ureason,
    load_ureason,
    subset,
    world_root_of,
)
from unicon.evaluation.suites import suite
from unicon.evaluation.ureason import runner as ur
from unicon.evaluation.ureason.judges import (
    REASONING_CHAIN_PROMPT,
    VISUAL_VERIFICATION_PROMPT,
    Judge,
    JudgePanel,
    ReasoningChainJudge,
    Verdict,
    VLMJudge,
    fill_prompt,
    parse_answer,
    verdict_from_reply,
)
from unicon.evaluation.ureason.metrics import SETTING_NAMES, UReasonMetric, compute_metrics, markdown_table
from unicon.errors import UserError
from unicon.models.base import TextGeneration


# ---------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------
@pytest.mark.shared
def test_release_loads_500_instances_paired_by_id(shared_data):
    root = shared_data / "ureason"
    instances = load_ureason(root)
    assert len(instances) == 500
    by_cat = {c: [i for i in instances if i.category == c] for c in CATEGORIES}
    assert {c: len(v) for c, v in by_cat.items()} == {c: 100 for c in CATEGORIES}
    # ids by category as documented in shared/data/README.md
    first = {"text": 1, "code": 101, "attribute": 201, "spatial": 301, "arithmetic": 401}
    for c, rows in by_cat.items():
        assert sorted(i.id for i in rows) == list(range(first[c], first[c] + 100))
    # independent re-read: every instance carries the direct row and the think row of its id
    for c in CATEGORIES:
        direct = {r["id"]: r for r in map(json.loads, (root / f"direct_{c}.jsonl").read_text().splitlines())}
        think = {r["id"]: r for r in map(json.loads, (root / f"{c}.jsonl").read_text().splitlines())}
        for inst in by_cat[c]:
            assert inst.direct_prompt == direct[inst.id]["prompt"]
            assert inst.prompt == think[inst.id]["prompt"]
            assert inst.expect_en == " ".join(think[inst.id]["expect_en"].split())
            assert inst.direct_prompt != inst.prompt
    assert len({i.key for i in instances}) == 500


def _write(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _row(i, cat="spatial", **kw):
    return {"id": i, "prompt": f"p{i}", "expect_en": f"c{i}", "category": cat, **kw}


def test_row_missing_criterion_or_category_names_file_and_line(tmp_path):
    _write(tmp_path / "direct_spatial.jsonl", [_row(1), {"id": 2, "prompt": "p", "category": "spatial"}])
    _write(tmp_path / "spatial.jsonl", [_row(1), _row(2)])
    with pytest.raises(UReasonFormatError, match=r"direct_spatial\.jsonl:2: row is missing expect_en"):
        load_ureason(tmp_path)
    _write(tmp_path / "direct_spatial.jsonl", [_row(1), _row(2)])
    _write(tmp_path / "spatial.jsonl", [_row(1), {"id": 2, "prompt": "p", "expect_en": "c"}])
    with pytest.raises(UReasonFormatError, match=r"spatial\.jsonl:2: row is missing category"):
        load_ureason(tmp_path)


def test_malformed_json_names_file_and_line(tmp_path):
    _write(tmp_path / "direct_code.jsonl", [_row(1, "code"), "", '{"id": 2, "prompt": '])
    _write(tmp_path / "code.jsonl", [_row(1, "code")])
    with pytest.raises(UReasonFormatError, match=r"direct_code\.jsonl:3: malformed JSON"):
        load_ureason(tmp_path)


def test_pairing_errors(tmp_path):
    _write(tmp_path / "direct_code.jsonl", [_row(1, "code"), _row(2, "code")])
    _write(tmp_path / "code.jsonl", [_row(1, "code"), _row(3, "code")])
    with pytest.raises(UReasonFormatError, match=r"ids .* differ .*only in direct: \[2\].*only in think: \[3\]"):
        load_ureason(tmp_path)
    _write(tmp_path / "code.jsonl", [_row(1, "code"), _row(1, "code")])
    with pytest.raises(UReasonFormatError, match=r"code\.jsonl:2: duplicate id 1 \(first on line 1\)"):
        load_ureason(tmp_path)
    _write(tmp_path / "code.jsonl", [_row(1, "code"), _row(2, "code", expect_en="something else")])
    with pytest.raises(UReasonFormatError, match=r"id 2: expect_en differs"):
        load_ureason(tmp_path)
    _write(tmp_path / "code.jsonl", [_row(1, "code"), _row(2, "spatial")])
    with pytest.raises(UReasonFormatError, match=r"code\.jsonl:2: category 'spatial' does not match"):
        load_ureason(tmp_path)
    with pytest.raises(UReasonFormatError, match="no files for categories"):
        load_ureason(tmp_path, categories=["text"])


def test_splits_from_subdirectories_or_a_split_field(tmp_path):
    for split, ids in (("test", [1, 2, 3]), ("testmini", [4])):
        (tmp_path / split).mkdir()
        _write(tmp_path / split / "direct_code.jsonl", [_row(i, "code") for i in ids])
        _write(tmp_path / split / "code.jsonl", [_row(i, "code") for i in ids])
    assert [i.id for i in load_ureason(tmp_path, split="testmini")] == [4]
    assert [i.id for i in load_ureason(tmp_path, split="test")] == [1, 2, 3]
    flat = tmp_path / "flat"
    flat.mkdir()
    rows = [_row(1, "code", split="test"), _row(2, "code", split="testmini"), _row(3, "code", split="test")]
    _write(flat / "direct_code.jsonl", rows)
    _write(flat / "code.jsonl", rows)
    assert [i.id for i in load_ureason(flat, split="test")] == [1, 3]
    assert len(load_ureason(flat)) == 3
    with pytest.raises(UReasonFormatError, match="split must be one of"):
        load_ureason(flat, split="train")


def test_shapes_prompts_need_a_target_scene(tmp_path):
    (tmp_path / "ureason").mkdir()
    scene = {"objects": [{"shape": "circle", "color": "red", "cell": [0, 0]}]}
    _write(tmp_path / "ureason" / "direct_arithmetic.jsonl", [_row(1, "arithmetic", target_scene=scene)])
    _write(tmp_path / "ureason" / "arithmetic.jsonl", [_row(1, "arithmetic", target_scene=scene)])
    (inst,) = load_shapes_ureason(tmp_path)
    assert inst.target_scene == scene
    _write(tmp_path / "ureason" / "arithmetic.jsonl", [_row(1, "arithmetic")])
    _write(tmp_path / "ureason" / "direct_arithmetic.jsonl", [_row(1, "arithmetic")])
    with pytest.raises(UReasonFormatError, match=r"arithmetic\.jsonl:1: ShapesWorld row has no 'target_scene'"):
        load_shapes_ureason(tmp_path)


# ---------------------------------------------------------------------------------------------
# refined-prompt extraction: traces written to trip a regex that also accepts a bare "prompt"
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "trace, text, rule",
    [
        # a later bare "prompt" must not win
        ("Let me count: 10-5-2-1 = 2.\nRefined prompt: Two red apples on a wooden table.\n"
         "This prompt keeps only the final state.",
         "Two red apples on a wooden table.\nThis prompt keeps only the final state.", "refined prompt"),
        ("The prompt asks for letters.\nrefined prompt: The letter 'G' on a label.\n"
         "Note that the original prompt mentioned Stop and Caution.",
         "The letter 'G' on a label.\nNote that the original prompt mentioned Stop and Caution.", "refined prompt"),
        # bold / heading markers and think tags
        ("<think>The user prompt wants a shelf. Draft prompt: a shelf.</think>\n"
         "**Refined Prompt:** A shelf with a cola.",
         "A shelf with a cola.", "refined prompt"),
        ("<think>reasoning</think>\n### Final Scene Prompt:\n{Three cats on a sofa.}", "Three cats on a sofa.",
         "final scene prompt"),
        ("Reasoning: 4 + 3 = 7\n__Final Prompt__: \"Seven blue cubes.\"", "Seven blue cubes.", "final prompt"),
        # the LAST explicit marker wins over an earlier one
        ("Refined prompt: five dogs.\nWait, two left. Refined prompt: three dogs.", "three dogs.", "refined prompt"),
        ("Final prompt: a cat.\nFINAL SCENE PROMPT: a dog.", "a dog.", "final scene prompt"),
        # only a wrapper around the whole text is removed
        ("refined prompt: {red} cube and {blue} ball", "{red} cube and {blue} ball", "refined prompt"),
        ("refined prompt: \"The letter 'G' on a label.\"", "The letter 'G' on a label.", "refined prompt"),
        # snake_case survives emphasis stripping
        ("menu_grid[0][0] = pizza\n\nrefined prompt: menu_grid shows a pizza", "menu_grid shows a pizza",
         "refined prompt"),
        # no explicit marker: last paragraph, even if it mentions "prompt"
        ("The prompt says 3 apples.\n\nThe prompt: two apples remain on the table.",
         "The prompt: two apples remain on the table.", "last_paragraph"),
        ("<think>hmm</think>\n\nA single green cone.\n\n", "A single green cone.", "last_paragraph"),
        # marker with nothing after it, or no text at all
        ("I will now write the refined prompt:", "", "empty"),
        ("<think></think>", "", "empty"),
    ],
)
def test_extract_refined_prompt(trace, text, rule):
    got = ur.extract_refined_prompt(trace)
    assert (got.text, got.rule) == (text, rule)
    assert got.fallback == (rule == "last_paragraph")


# ---------------------------------------------------------------------------------------------
# strict answer parsing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reply, status",
    [
        ("The image shows 3 apples. <answer>Yes</answer>", "yes"),
        ("<answer> no. </answer>", "no"),
        ("<ANSWER>YES</ANSWER>", "yes"),
        ("I do not know.", "unparseable"),  # a substring judge scores this "no"
        ("<answer>I do not know</answer>", "unparseable"),
        ("Not sure; the cats are not visible.", "unparseable"),
        ("No.", "unparseable"),  # no tag, no guess
        ("<answer>Yes, mostly</answer>", "unparseable"),
        # the format is quoted first, the final tag decides
        ("If it matches, output <answer>Yes</answer>. Here it does not. <answer>No</answer>", "no"),
        ("", "unparseable"),
    ],
)
def test_parse_answer_is_strict(reply, status):
    assert parse_answer(reply) == status


def test_reply_length_limit_truncates_and_flags():
    reply = "step " * 100 + "<answer>Yes</answer>"
    v = verdict_from_reply(reply, max_reply_chars=50)
    assert (v.status, v.truncated, len(v.reply)) == ("unparseable", True, 50)
    v = verdict_from_reply(reply, max_reply_chars=10_000)
    assert (v.status, v.truncated) == ("yes", False)
    assert verdict_from_reply("<answer>No</answer>", hit_token_limit=True).truncated


def _flat(text: str) -> str:
    return " ".join(text.replace("\u2019", "'").split())


@pytest.mark.shared
def test_judge_prompts_match_the_paper_appendix_f(shared_dir):
    paper = _flat((shared_dir / "papers" / "ureason-reasoning-paradox.txt").read_text())
    fig19 = paper.split("Evaluation Prompt for Visual Verification Accuracy ", 1)[1].split(" Figure 19:", 1)[0]
    fig20 = paper.split("Evaluation Prompt for the Quality of Reasoning Chain ", 1)[1].split(" Figure 20:", 1)[0]
    assert _flat(VISUAL_VERIFICATION_PROMPT) == fig19
    assert _flat(REASONING_CHAIN_PROMPT) == fig20
    # code in a user prompt holds braces; the substitution must not choke on them
    text = fill_prompt(REASONING_CHAIN_PROMPT, user_prompt="x = {'a': 1} {criteria}", model_thought="R",
                       criteria="C")
    assert "x = {'a': 1} {criteria}" in text and "=== Target Criteria ===\nC\n" in text


# ---------------------------------------------------------------------------------------------
# metrics by hand
# ---------------------------------------------------------------------------------------------
def _inst(i, cat):
    return UReasonInstance(id=i, category=cat, direct_prompt=f"d{i}", prompt=f"p{i}", expect_en=f"c{i}")


def _sample(i, cat, statuses, images=(True, True, True), chain=None, rule="refined prompt"):
    s = ur.Sample(_inst(i, cat), refined=ur.Extraction("x" if rule != "empty" else "", rule))
    for k, st, has in zip((1, 2, 3), statuses, images):
        s.images[k] = Image.new("RGB", (4, 4)) if has else None
        s.verdicts[k] = Verdict(st)
    s.chain = None if chain is None else Verdict(chain)
    return s


def _records(samples):
    return [ur.sample_record(s, {}) for s in samples]


def test_metrics_by_hand_missing_image_is_a_failure():
    samples = [
        _sample(1, "code", ("no", "yes", "yes"), chain="yes"),
        _sample(2, "code", ("no", "no", "yes"), chain="yes", rule="last_paragraph"),
        _sample(3, "code", ("yes", "yes", "no_input"), images=(True, True, False), chain="no", rule="empty"),
        _sample(4, "text", ("no", "unparseable", "yes"), chain="yes"),
        _sample(5, "text", ("no_input", "no", "yes"), images=(False, True, True), chain="unparseable"),
    ]
    m = compute_metrics(_records(samples))
    assert m["n"] == 5
    assert m["acc_s1"] == pytest.approx(100 * 1 / 5)
    assert m["acc_s2"] == pytest.approx(100 * 2 / 5)
    assert m["acc_s3"] == pytest.approx(100 * 4 / 5)
    assert m["delta_12"] == pytest.approx(20.0) and m["delta_23"] == pytest.approx(40.0)
    # the reference's denominator would drop the missing image
    assert m["acc_s1_excl_missing"] == pytest.approx(100 * 1 / 4)
    assert m["acc_s3_excl_missing"] == pytest.approx(100 * 4 / 4)
    assert m["acc_s1/code"] == pytest.approx(100 / 3) and m["acc_s3/code"] == pytest.approx(200 / 3)
    assert m["acc_s2/text"] == 0.0 and m["acc_s3/text"] == 100.0
    assert m["delta_23/text"] == 100.0
    assert m["chain_acc"] == pytest.approx(60.0) and m["chain_acc/code"] == pytest.approx(200 / 3)
    assert m["fallback_rate"] == pytest.approx(20.0) and m["empty_refined_rate"] == pytest.approx(20.0)
    assert (m["missing_s1"], m["missing_s2"], m["missing_s3"]) == (1, 0, 1)
    assert (m["unparseable_s1"], m["unparseable_s2"], m["unparseable_s3"]) == (0, 1, 0)
    assert m["chain_unparseable"] == 1
    table = markdown_table(m, ["code", "text"])
    assert "| 3 De-contextualized | 66.7 | +0.0 | 100.0 | +100.0 | 80.0 | +40.0 |" in table
    assert "| 1 Direct | 33.3 | - | 0.0 | - | 20.0 | - |" in table


# ---------------------------------------------------------------------------------------------
# a deterministic test double of a unified model and a colour judge
# ---------------------------------------------------------------------------------------------
COLORS = standins.FAKE_COLORS


def ColorDouble(fail_on: str | None = None) -> standins.FakeModel:
    """Draws a solid image of the LAST colour word in (context + prompt); reasons by echoing the
    first colour word of the prompt into a refined prompt, wrapped in distracting commentary
    (``standins.FakeModel``'s ``draw="color"``); ``image_calls`` records (prompts, contexts)."""
    return standins.FakeModel(draw="color", fail_on=fail_on)


class ColorJudge(Judge):
    """Yes iff the image's colour is the criterion's colour word; chains: refined prompt names it."""

    name = "color"
    judges_reasoning = True

    def judge_images(self, instances, images):
        out = []
        for inst, im in zip(instances, images):
            if im is None:
                out.append(Verdict("no_input"))
                continue
            rgb = im.getpixel((0, 0))
            ok = COLORS.get(inst.expect_en) == rgb
            out.append(Verdict("yes" if ok else "no", f"<answer>{'Yes' if ok else 'No'}</answer>"))
        return out

    def judge_reasoning(self, instances, traces, refined_prompts):
        return [Verdict("yes" if i.expect_en in r else "no") for i, r in zip(instances, refined_prompts)]


def _color_instances():
    # target colour = criterion; the think prompt names the target first and a distractor last
    spec = [(1, "code", "red", "green"), (2, "code", "blue", "red"), (3, "spatial", "green", "blue"),
            (4, "spatial", "red", "red")]
    return [
        UReasonInstance(id=i, category=cat, direct_prompt=f"draw it, not {distractor}",
                        prompt=f"the answer is {target}; ignore {distractor}", expect_en=target)
        for i, cat, target, distractor in spec
    ]


def test_three_settings_with_a_test_double_and_outputs(tmp_path):
    model = ColorDouble(fail_on="blue")  # setting 3 of instance 2 ("a blue square") fails to draw
    instances = _color_instances()
    metrics, samples = ur.evaluate_ureason(model, instances, ColorJudge(), out_dir=tmp_path, batch_size=3)
    # s1: the direct prompt names only the distractor -> correct only for id 4 (red/red)
    # s2: last colour in trace+prompt is the distractor -> correct only for id 4
    # s3: refined prompt "a <target> square" -> correct except id 2 whose image failed
    assert [s.passed(1) for s in samples] == [False, False, False, True]
    assert [s.passed(2) for s in samples] == [False, False, False, True]
    assert [s.passed(3) for s in samples] == [True, False, True, True]
    assert metrics["acc_s1"] == 25.0 and metrics["acc_s2"] == 25.0 and metrics["acc_s3"] == 75.0
    assert metrics["delta_23"] == 50.0 and metrics["missing_s3"] == 1.0
    assert metrics["acc_s3_excl_missing"] == 100.0
    assert metrics["chain_acc"] == 100.0 and metrics["fallback_rate"] == 0.0
    # setting 2 passes the trace as context; setting 3 passes R_p alone
    s2_calls = [c for c in model.image_calls if c[1] is not None]
    assert s2_calls and s2_calls[0][1][0] == samples[0].trace
    assert any(c[0] == ["a red square", "a blue square", "a green square"] for c in model.image_calls)
    # outputs
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    r = rows[1]
    assert r["refined_prompt"] == "a blue square" and r["extraction_rule"] == "refined prompt"
    assert r["image_s3"] is None and "cannot draw" in r["image_error_s3"] and r["verdict_s3"] == "no_input"
    assert r["trace_truncated"] is False and r["judge_reply_s1"] == "<answer>No</answer>"
    assert (tmp_path / rows[0]["image_s1"]).is_file()
    saved = json.loads((tmp_path / "ureason.json").read_text())
    assert saved["metrics"]["acc_s3"] == 75.0 and saved["judge"] == "color"
    assert "| 2 Reasoning-Guided |" in (tmp_path / "table.md").read_text()


def test_a_preemption_while_drawing_stops_generation_instead_of_failing_the_images(monkeypatch):
    """A failed image is a scored failure, a preemption signal is not: it leaves generate_samples."""
    from unicon.evaluation import preemption

    model = ColorDouble()

    def preempted(prompts, context=None, config=None):
        raise preemption.Preempted(15)

    monkeypatch.setattr(model, "generate_image", preempted)
    with pytest.raises(preemption.Preempted):
        ur.generate_samples(model, _color_instances(), batch_size=2)


def test_truncated_trace_is_flagged(tmp_path):
    metrics, samples = ur.evaluate_ureason(ColorDouble(), _color_instances()[:2], ColorJudge(), max_new_tokens=3)
    assert all(s.trace_truncated for s in samples) and metrics["trace_truncated"] == 2.0


def test_subset_is_round_robin_over_categories():
    inst = [_inst(i, c) for c, n in (("code", 3), ("text", 1), ("spatial", 2)) for i in range(n)]
    got = subset(inst, 4)
    assert [(i.category, i.id) for i in got] == [("code", 0), ("text", 0), ("spatial", 0), ("code", 1)]


def test_cli_and_loggers(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    for cat in ("code", "spatial"):
        rows = [{"id": i.id, "prompt": i.prompt, "expect_en": i.expect_en, "category": cat}
                for i in _color_instances() if i.category == cat]
        direct = [{**r, "prompt": i.direct_prompt} for r, i in
                  zip(rows, [i for i in _color_instances() if i.category == cat])]
        _write(data / f"{cat}.jsonl", rows)
        _write(data / f"direct_{cat}.jsonl", direct)
    import unicon.evaluation.ureason.judges as judges
    import unicon.models as models

    monkeypatch.setattr(models, "load_model", lambda path, **kw: ColorDouble(), raising=False)
    monkeypatch.setattr(judges, "build_judge", lambda spec, **kw: ColorJudge())  # the command imports it late

    ckpt, vlm = tmp_path / "ckpt", tmp_path / "vlm"  # local directories (the doubles load nothing from them)
    ckpt.mkdir()
    vlm.mkdir()
    with pytest.raises(UserError, match="judge 'exact' needs ShapesWorld prompts"):
        suite("ureason").cli(["--ckpt", str(ckpt), "--data", str(data), "--out", str(tmp_path / "o"), "--judge", "exact"])
    out = tmp_path / "out"
    assert suite("ureason").cli(["--ckpt", str(ckpt), "--data", str(data), "--out", str(out), "--logger", "none",
                   "--device", "cpu", "--judge", f"vlm:{vlm}"]) == 0
    saved = json.loads((out / "ureason.json").read_text())
    metrics = saved["metrics"]
    assert metrics["acc_s3"] == 100.0 and metrics["acc_s1/code"] == 0.0
    # the run records what produced it
    assert saved["generation"]["max_new_tokens"] == UReasonEvalConfig.max_new_tokens
    assert saved["generation"]["image"]["seed"] is None and saved["judge"] == "color"
    assert saved["model_fingerprint"] and "versions.torch" in saved["environment"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["ureason/acc_s3"] == 100.0
    table = [json.loads(line) for line in (out / "tables" / "ureason_samples.jsonl").read_text().splitlines()]
    assert len(table) == 4 and all(Path(out / "tables" / t["image_s1"]).is_file() for t in table)
    with pytest.raises(SystemExit):
        suite("ureason").cli(["--help"])


def test_cli_defaults_are_the_config_defaults():
    args = suite("ureason").parser().parse_args(["--ckpt", "c", "--out", "o", "--data", "d"])
    config = UReasonEvalConfig()
    for name in ("judge", "chain_judge", "max_new_tokens", "batch_size", "table_rows"):
        assert getattr(args, name) == getattr(config, name), name
    assert args.max_samples is None  # the standalone benchmark runs every instance


def test_callback_logs_headline_metrics(tmp_path):
    import lightning.pytorch as pl

    from unicon.loggers import JsonlLogger

    data = tmp_path / "data"
    data.mkdir()
    for cat in ("code", "spatial"):
        chosen = [i for i in _color_instances() if i.category == cat]
        _write(data / f"{cat}.jsonl",
               [{"id": i.id, "prompt": i.prompt, "expect_en": i.expect_en, "category": cat} for i in chosen])
        _write(data / f"direct_{cat}.jsonl",
               [{"id": i.id, "prompt": i.direct_prompt, "expect_en": i.expect_en, "category": cat} for i in chosen])

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = ColorDouble()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, idx):
            return (self.w - batch[0]).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from unicon.evaluation.callbacks import SuiteCallback

    cb = SuiteCallback(suite("ureason"), UReasonEvalConfig(data=str(data), judge="vlm:color-double", max_samples=3),
                       fail_on_error=True)
    cb.cache["judge"] = ColorJudge()  # the judge the epoch ends use
    trainer = pl.Trainer(max_epochs=1, logger=[JsonlLogger(tmp_path)], callbacks=[cb], default_root_dir=tmp_path,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu")
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1))
    logged = {k: v for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              for k, v in row.items()}
    # subset of 3 round-robin: ids 1 (code), 3 (spatial), 2 (code) -> s3 correct for 1, 3 and 2
    assert logged["ureason/failed"] == 0.0
    assert logged["ureason/acc_s1"] == 0.0 and logged["ureason/acc_s3"] == 100.0
    assert logged["ureason/delta_23"] == 100.0 and logged["ureason/delta_12"] == 0.0
    assert (tmp_path / "eval" / "ureason" / "epoch-1" / "ureason.json").is_file()
    # every metric of ureason.json under the name `unicon evaluate ureason` logs it (per category too)
    saved = json.loads((tmp_path / "eval" / "ureason" / "epoch-1" / "ureason.json").read_text())["metrics"]
    assert {f"ureason/{k}" for k in saved} <= set(logged) and "ureason/acc_s1/code" in logged
    table = (tmp_path / "tables" / "ureason_samples.jsonl").read_text().splitlines()
    assert [json.loads(r)["id"] for r in table] == ["1", "3", "2"]


# ---------------------------------------------------------------------------------------------
# tiny randomly initialised judge models (wiring only; no downloads)
# ---------------------------------------------------------------------------------------------
VLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _word_tokenizer(specials):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = re.findall(r"\w+|[^\w\s]", VISUAL_VERIFICATION_PROMPT + REASONING_CHAIN_PROMPT + " red square")
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + ["[UNK]"] + words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", chat_template=CHAT_TEMPLATE), vocab


def _reference_replies(model, tokenizer, inputs, max_new_tokens):
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    new = out[:, inputs["input_ids"].shape[1]:]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [(tokenizer.decode(r, skip_special_tokens=True).strip(), eos not in r.tolist()) for r in new]


def test_vlm_judge_wiring_with_a_tiny_qwen2_vl(tmp_path):
    import standins

    standins.qwen2_vl(tmp_path / "vlm")  # a 1-layer Qwen2-VL over this file's word vocabulary

    judge = VLMJudge.from_pretrained(str(tmp_path / "vlm"), max_new_tokens=6, batch_size=2)
    instances = [_inst(i, "code") for i in range(3)]
    images = [Image.new("RGB", (64, 64), "red"), None, Image.new("RGB", (40, 80), "blue")]
    verdicts = judge.judge_images(instances, images)
    assert verdicts[1].status == "no_input"
    # independent re-run of the same model on the same two prompts
    text = [judge.build_text(instances[i].expect_en) for i in (0, 2)]
    assert 'Target Description: "c0"' in text[0] and "<|image_pad|>" in text[0]
    inputs = judge.processor(text=text, images=[images[0], images[2]], return_tensors="pt", padding=True)
    expected = _reference_replies(judge.model, judge.tokenizer, inputs, 6)
    for v, (reply, hit) in zip([verdicts[0], verdicts[2]], expected):
        assert v.reply == reply and v.truncated == hit and v.status == parse_answer(reply)
    # judge dtypes are the names of unicon.core.DTYPES (aliases included) or "auto"
    assert VLMJudge.from_pretrained(str(tmp_path / "vlm"), dtype="bf16").model.dtype == torch.bfloat16
    with pytest.raises(UserError, match="judge dtype must be one of float32, .*auto, got 'int8'"):
        VLMJudge.from_pretrained(str(tmp_path / "vlm"), dtype="int8")


def test_chain_judge_wiring_with_a_tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer, vocab = _word_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"],
                                 bos_token_id=None)).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    chain = ReasoningChainJudge.from_pretrained(str(tmp_path / "lm"), max_new_tokens=5, batch_size=2)
    instances = [_inst(i, "code") for i in range(3)]
    traces = ["red square", "", "refined prompt: red square"]
    verdicts = chain.judge_reasoning(instances, traces, ["red square", "", "red square"])
    assert verdicts[1].status == "no_input"
    text = [chain.build_text(instances[i].prompt, traces[i], instances[i].expect_en) for i in (0, 2)]
    assert text[0].startswith("<|im_start|>user\nYou are an objective logic evaluator.")
    assert "=== Model Thought Process ===\nred square\n=== Target Criteria ===\nc0" in text[0]
    inputs = chain.tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False)
    expected = _reference_replies(chain.model, chain.tokenizer, inputs, 5)
    for v, (reply, hit) in zip([verdicts[0], verdicts[2]], expected):
        assert v.reply == reply and v.truncated == hit and v.status == parse_answer(reply)
    # a panel routes images and chains to their own judges
    panel = JudgePanel(ColorJudge(), chain)
    assert panel.judges_reasoning and panel.name == "color+chain-llm"
    with pytest.raises(NotImplementedError):
        chain.judge_images(instances, [None] * 3)


# ---------------------------------------------------------------------------------------------
# ShapesWorld: exact judge and a run of the three settings
# ---------------------------------------------------------------------------------------------
PATTERN = {"objects": [{"shape": "circle", "color": "red"}, {"shape": "square", "color": "blue"},
                       {"shape": "circle", "color": "red"}],
           "relations": [{"subject": 0, "relation": "left", "object": 1}]}


@pytest.mark.parametrize(
    "text, ok",
    [
        ("a blue square to the right of a red circle and a red circle", True),  # inverse relation
        ("a red circle left of a blue square, a red circle", True),
        ("two red circles and a blue square", False),  # relation not stated
        ("a red circle to the left of a blue square", False),  # one red circle missing
        ("a circle to the left of a blue square and a red circle", False),  # colour not named
        ("a red circle above a blue square and a red circle", False),  # wrong relation
        ("the answer is two red circles", False),  # outside the grammar
    ],
)
def test_refined_prompt_implies_pattern(text, ok):
    from unicon.evaluation.ureason.judges import refined_prompt_implies

    assert refined_prompt_implies(text, PATTERN) is ok


def test_exact_judge_on_rendered_scenes():
    from unicon.evaluation.ureason.judges import ShapesJudge
    from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, render

    cfg = WorldConfig()
    good = render(Scene((ShapeObject("circle", "red", 0, 0), ShapeObject("square", "blue", 0, 2),
                         ShapeObject("circle", "red", 3, 3))), cfg, seed=1)
    bad = render(Scene((ShapeObject("circle", "red", 0, 3), ShapeObject("square", "blue", 0, 2),
                        ShapeObject("circle", "red", 3, 3))), cfg, seed=1)
    inst = UReasonInstance(id=1, category="spatial", direct_prompt="d", prompt="p", expect_en="c",
                           target_scene=PATTERN)
    judge = ShapesJudge(cfg)
    got = judge.judge_images([inst] * 4, [good, bad, None, Image.new("RGB", (64, 64), "white")])
    assert [v.status for v in got] == ["yes", "no", "no_input", "no"]
    chains = judge.judge_reasoning([inst] * 2, ["t", "t"], ["a red circle left of a blue square, a red circle", ""])
    assert [v.status for v in chains] == ["yes", "no_input"]
    with pytest.raises(Exception, match="needs 'target_scene'"):
        judge.judge_images([_inst(1, "code")], [good])


class ShapesDouble(standins.FakeModel):
    """Test double of a think-then-draw ShapesWorld model: it draws the scene of a caption it knows
    (an empty board otherwise) and reasons by an answer key with one wrong answer."""

    def __init__(self, drawings: dict, answers: dict, cfg):
        super().__init__()
        self.drawings, self.answers, self.cfg = drawings, answers, cfg

    def generate_image(self, prompts, context=None, config=None):
        from unicon.worlds.shapes import Scene, render

        self.image_calls.append((list(prompts), None if context is None else list(context)))
        return [render(self.drawings.get(p if context is None else None, Scene()), self.cfg) for p in prompts]

    def reason(self, prompts, max_new_tokens=256):
        return [TextGeneration(f"<think>count the shapes</think>\nrefined prompt: {self.answers[p]}", False, 9)
                for p in prompts]


def test_shapes_run_reports_all_three_settings(tmp_path):
    """A ShapesWorld-format run (the tiny trained OFA is not used here: a deterministic test double)."""
    from unicon.evaluation.ureason.judges import ShapesJudge
    from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig

    cfg = WorldConfig()
    one_red = {"objects": [{"shape": "circle", "color": "red"}]}
    world = tmp_path / "world" / "ureason"
    world.mkdir(parents=True)
    rows = {"arithmetic": [(1, "there were three red circles; two rolled away", one_red)],
            "spatial": [(2, "the red circles hug a blue square", PATTERN)]}
    for cat, items in rows.items():
        _write(world / f"direct_{cat}.jsonl", [{"id": i, "prompt": "draw: " + p, "expect_en": "c", "category": cat,
                                                  "target_scene": t} for i, p, t in items])
        _write(world / f"{cat}.jsonl", [{"id": i, "prompt": "think: " + p, "expect_en": "c", "category": cat,
                                           "target_scene": t} for i, p, t in items])
    instances = load_instances(tmp_path / "world")
    drawings = {
        "a red circle": Scene((ShapeObject("circle", "red", 1, 1),)),
        "two red circles and a blue square": Scene((ShapeObject("circle", "red", 0, 0),
                                                    ShapeObject("square", "blue", 0, 2),
                                                    ShapeObject("circle", "red", 3, 3))),
    }
    answers = {"think: there were three red circles; two rolled away": "a red circle",
               "think: the red circles hug a blue square": "two red circles and a blue square"}
    model = ShapesDouble(drawings, answers, cfg)
    metrics, samples = ur.evaluate_ureason(model, instances, ShapesJudge(cfg), out_dir=tmp_path / "out")
    # s1/s2 draw an empty board (prompt unknown to the double) -> fail; s3 draws the refined prompt:
    # correct for arithmetic; for spatial the scene happens to satisfy the pattern but the
    # refined prompt does not state the relation -> image correct, chain wrong.
    assert (metrics["acc_s1"], metrics["acc_s2"], metrics["acc_s3"]) == (0.0, 0.0, 100.0)
    assert metrics["acc_s3/arithmetic"] == 100.0 and metrics["acc_s3/spatial"] == 100.0
    assert metrics["chain_acc/arithmetic"] == 100.0 and metrics["chain_acc/spatial"] == 0.0
    assert metrics["delta_23"] == 100.0 and metrics["fallback_rate"] == 0.0
    table = (tmp_path / "out" / "table.md").read_text()
    for k in (1, 2, 3):
        assert f"| {k} {SETTING_NAMES[k]} |" in table


@pytest.fixture(scope="module")
def shapes_world(tmp_path_factory):
    """A small ShapesWorld built by ``unicon build-data shapes`` (3 UReason prompts per category)."""
    import data_builders.shapes as builder

    out = tmp_path_factory.mktemp("ureason_world") / "world"
    assert builder.main(["--out", str(out), "--seed", "5", "--num-train", "60", "--num-val", "10", "--num-test", "10",
                         "--num-reason-train", "10", "--num-ureason", "3", "--geneval-per-tag", "2",
                         "--num-drift-seeds", "4", "--quiet", *standins.SMALL_INSTRUCT]) == 0
    return out


def test_shapes_gold_traces_pass_extraction_and_the_exact_chain_check(shapes_world):
    """The builder's own think-then-draw traces are the ideal chains: all must be judged correct."""
    from unicon.evaluation.ureason.judges import ShapesJudge

    instances = load_instances(shapes_world)
    assert {i.category for i in instances} == {"arithmetic", "attribute", "spatial", "code"} and len(instances) == 12
    gold = {}
    for cat in ("arithmetic", "attribute", "spatial", "code"):
        for row in map(json.loads, (shapes_world / "ureason" / f"{cat}.jsonl").read_text().splitlines()):
            gold[(cat, row["id"])] = row["trace"]
    traces = [gold[(i.category, i.id)] for i in instances]
    refined = [ur.extract_refined_prompt(t) for t in traces]
    assert all(r.rule == "refined prompt" for r in refined)
    judge = ShapesJudge.from_world(str(shapes_world))
    verdicts = judge.judge_reasoning(instances, traces, [r.text for r in refined])
    assert all(v.status == "yes" for v in verdicts)
    # a wrong chain (another instance's answer) is rejected
    wrong = judge.judge_reasoning(instances, traces, [r.text for r in refined[1:] + refined[:1]])
    assert sum(v.status == "yes" for v in wrong) < len(instances)


def test_shapes_run_with_a_tiny_ofa(shapes_world, tmp_path):
    """The real OFA backend (randomly initialised tiny preset; no trained checkpoint here) through
    all three settings with the exact judge; verdicts re-checked from the saved PNGs."""
    from unicon.models import build_model
    from unicon.evaluation.ureason.judges import build_judge
    from unicon.worlds.shapes import load_world
    from unicon.worlds.shapes_verify import check_criterion

    torch.manual_seed(0)
    model = build_model({"backend": "ofa", "preset": "shapes-tiny",
                         "arch": {"num_bins": 65, "max_source_length": 48, "max_target_length": 16, "num_beams": 1,
                                  "max_new_tokens": 16, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
                                  "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                                  "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}}, shapes_world)
    instances = subset(load_instances(shapes_world), 4)
    judge = build_judge("exact", world_root=world_root_of(shapes_world))
    out = tmp_path / "out"
    metrics, samples = ur.evaluate_ureason(model, instances, judge, out_dir=out, max_new_tokens=16, batch_size=4)
    cfg = load_world(shapes_world).config
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row, inst in zip(rows, instances):
        assert row["trace_tokens"] <= 16 and isinstance(row["trace_truncated"], bool)
        for k in (1, 2, 3):
            if row[f"image_s{k}"] is None:  # only an empty refined prompt may leave no image
                assert k == 3 and row["extraction_rule"] == "empty" and row[f"verdict_s{k}"] == "no_input"
                continue
            image = Image.open(out / row[f"image_s{k}"])
            assert image.size == (cfg.canvas, cfg.canvas)
            assert row[f"correct_s{k}"] == check_criterion(inst.target_scene, image, cfg)
    for k in (1, 2, 3):
        assert metrics[f"acc_s{k}"] == pytest.approx(100 * sum(r[f"correct_s{k}"] for r in rows) / 4)
        for cat in {i.category for i in instances}:
            assert f"acc_s{k}/{cat}" in metrics
    assert metrics["fallback_rate"] == pytest.approx(100 * sum(r["extraction_rule"] == "last_paragraph"
                                                               for r in rows) / 4)


def test_metric_states_summed_over_shards_give_the_full_metrics():
    """What torchmetrics' sync does under DDP: states of disjoint shards added == one pass over all."""
    samples = [
        _sample(1, "code", ("no", "yes", "yes"), chain="yes"),
        _sample(2, "code", ("no", "no", "yes"), chain="no", rule="last_paragraph"),
        _sample(3, "text", ("yes", "unparseable", "no_input"), images=(True, True, False), chain="yes"),
        _sample(4, "text", ("no_input", "no", "yes"), images=(False, True, True), chain="yes"),
        _sample(5, "code", ("yes", "yes", "yes"), chain="yes"),
    ]
    cats = ["code", "text"]
    shards = [UReasonMetric(cats), UReasonMetric(cats)]
    shards[0].update(_records(samples[0::2]))
    shards[1].update(_records(samples[1::2]))
    shards[0].merge_state(shards[1])
    full = compute_metrics(_records(samples), cats)
    sharded = shards[0].compute()
    assert list(sharded) == list(full)
    for k in full:
        assert sharded[k] == pytest.approx(full[k], nan_ok=True), k
    with pytest.raises(ValueError, match="category 'spatial'"):
        UReasonMetric(cats).update(_records([_sample(6, "spatial", ("yes", "yes", "yes"))]))


# ---------------------------------------------------------------------------------------------
# DDP: the production path in 2 gloo ranks == 1 process
# ---------------------------------------------------------------------------------------------
def _ddp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        metrics, samples = ur.evaluate_ureason(ColorDouble(fail_on="blue"), _ddp_instances(), ColorJudge(),
                                               out_dir=Path(out_dir) / "ddp", batch_size=2)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"metrics": metrics,
                                                                 "ids": [s.instance.id for s in samples]}))
    finally:
        dist.destroy_process_group()


def _ddp_instances():
    # 5 instances on 2 ranks: the sampler pads rank 1 with a repeat of instance 0
    extra = UReasonInstance(id=5, category="spatial", direct_prompt="draw green", prompt="the answer is blue",
                            expect_en="blue")
    return [*_color_instances(), extra]


@pytest.mark.timeout(180)
def test_ddp_two_gloo_ranks_match_one_process(tmp_path, fork_safe_threads):
    import torch.multiprocessing as mp

    one, _ = ur.evaluate_ureason(ColorDouble(fail_on="blue"), _ddp_instances(), ColorJudge(),
                                 out_dir=tmp_path / "one", batch_size=2)
    assert one["n"] == 5 and one["missing_s3"] == 2.0  # the blue refined prompts fail to draw
    # fork: the children inherit the imported modules and this file's test doubles
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["ids"] for r in ranks] == [[1, 3, 5], [2, 4, 1]]  # instance 1 evaluated twice, counted once
    for r in ranks:
        assert r["metrics"] == json.loads(json.dumps(one))
    for name in ("samples.jsonl", "ureason.json", "table.md"):
        assert (tmp_path / "ddp" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    images = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.png"))
    assert images and images == sorted(p.relative_to(tmp_path / "ddp") for p in (tmp_path / "ddp").rglob("*.png"))
