"""EditingScore (``unicon evaluate editing``): the components against a hand computation, Kendall tau_b
against scipy on the per-sample file, the Table 4 ablations, the loader's refusals, ShapesWorld's exact
candidate ratings, the embedding methods of the three backends (tiny random configs), and an
end-to-end CLI run (one process, two shards + merge, the model's own edits) on a tiny world."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import kendalltau

from unicon.errors import UserError
from unicon.evaluation.editing.data import CRITERIA, load_samples
from unicon.evaluation.editing.metrics import EPS, editing_components
from unicon.evaluation.editing.runner import score_images
from unicon.models.base import EmbeddingNotSupported, UnifiedModel
from unicon.worlds.shapes import Scene, load_world, parse
from unicon.worlds.shapes_editscore import CANDIDATES, cells, write_editscore_set

sys.path.insert(0, str(Path(__file__).parent))
from test_edit_image import _decoupled, _janus, _ofa  # noqa: E402  (the tiny configs of the three backends)

BACKENDS = ("ofa", "janus", "decoupled")


@pytest.fixture(scope="module")
def world(tiny_shapes_world) -> Path:
    assert (tiny_shapes_world / "editscore" / "editscore.jsonl").is_file(), "the builder wrote no editscore set"
    return tiny_shapes_world


@pytest.fixture(scope="module")
def ofa(world):
    return _ofa(world).eval()


def _images(world: Path, n: int = 2) -> list[Image.Image]:
    rows = [json.loads(line) for line in (world / "editscore" / "editscore.jsonl").read_text().splitlines()]
    paths = [world / "editscore" / rows[0]["source_image"]] + [world / "editscore" / r["edited_image"] for r in rows]
    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(im.convert("RGB"))
    return out[:n]


# ---- the score ---------------------------------------------------------------------------------
def test_components_match_a_hand_computation_on_two_images(ofa, world):
    a, b = _images(world, 3)[1:3]
    src, edited, text = [a, a], [b, a], ["paint the red circle blue", "remove the star"]
    got = score_images(ofa, src, edited, text)
    z_s = ofa.image_latents(src).numpy().astype(np.float64)
    z_t = ofa.image_latents(edited).numpy().astype(np.float64)
    f_hat = ofa.embed_image(edited).numpy().astype(np.float64)
    p = ofa.embed_text(text).numpy().astype(np.float64)
    for k in range(2):
        cos = z_s[k] @ z_t[k] / (np.sqrt(z_s[k] @ z_s[k]) * np.sqrt(z_t[k] @ z_t[k]))
        sim = p[k] @ f_hat[k] / (np.sqrt(p[k] @ p[k]) * np.sqrt(f_hat[k] @ f_hat[k]))
        rls = np.sqrt(((z_s[k] - z_t[k]) ** 2).sum()) / np.sqrt(z_s.shape[1])
        # float64 arithmetic on the same float32 latents: only reduction-order rounding differs
        tol = 64 * np.finfo(np.float64).eps
        assert got["cos_image"][k] == pytest.approx(cos, rel=tol, abs=tol)
        assert got["sim_text"][k] == pytest.approx(sim, rel=tol, abs=tol)
        assert got["rls"][k] == pytest.approx(rls, rel=tol, abs=tol)
        assert got["no_rls"][k] == pytest.approx(cos * sim, rel=4 * tol, abs=tol)
        if k == 0:  # a real change: the denominator is rls^2 (eps negligible)
            assert rls > 0
            assert got["score"][k] == pytest.approx(cos * sim / (rls ** 2 + EPS), rel=1e-9)
            assert got["no_cos"][k] == pytest.approx(sim / (rls ** 2 + EPS), rel=1e-9)
            assert got["no_sim_text"][k] == pytest.approx(cos / (rls ** 2 + EPS), rel=1e-9)
    # no change at all: rls == 0 exactly, and the raw score is cos * sim / eps (the paper's formula is
    # largest for the smallest edit, against its "lower is better, in [0, 1]")
    assert got["rls"][1] == 0.0
    assert got["score"][1] == pytest.approx(got["sim_text"][1] / EPS, rel=1e-12)
    assert abs(got["score"][1]) > abs(got["score"][0])


def test_components_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="latents"):
        editing_components(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 5), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="embeddings"):
        editing_components(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 5), torch.ones(2, 6))


# ---- embeddings per backend --------------------------------------------------------------------
@pytest.fixture(scope="module")
def backends(world, ofa):
    return {"ofa": ofa, "janus": _janus().eval(), "decoupled": _decoupled().eval()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_methods_shape_determinism_and_dependence_on_the_image(backends, world, backend):
    model = backends[backend]
    ims = _images(world, 3)
    z = model.image_latents(ims)
    e = model.embed_image(ims)
    t = model.embed_text(["paint the red circle blue", "remove the star", "x"])
    assert z.dtype == e.dtype == t.dtype == torch.float32
    assert z.ndim == 2 and z.shape[0] == 3 and z.shape[1] > e.shape[1]  # flattened latents vs pooled embeddings
    assert e.shape == t.shape and e.shape[0] == 3
    assert torch.isfinite(z).all() and torch.isfinite(e).all() and torch.isfinite(t).all()
    assert torch.equal(model.image_latents(ims), z) and torch.equal(model.embed_image(ims), e)
    assert torch.equal(model.embed_text(["paint the red circle blue", "remove the star", "x"]), t)
    # one image alone gives its row of the batch (no cross-row leakage)
    torch.testing.assert_close(model.image_latents(ims[1:2])[0], z[1], rtol=1e-5, atol=1e-5)
    for i in range(3):  # different images -> different latents and embeddings; different texts too
        for j in range(i + 1, 3):
            assert not torch.allclose(z[i], z[j]) and not torch.allclose(e[i], e[j]) and not torch.allclose(t[i], t[j])


def test_a_backend_without_embeddings_refuses_naming_it():
    class Bare(UnifiedModel):
        backend = "bare"

    for name in Bare.__abstractmethods__:
        setattr(Bare, name, lambda *a, **k: None)
    Bare.__abstractmethods__ = frozenset()
    for call in (lambda m: m.image_latents([]), lambda m: m.embed_image([]), lambda m: m.embed_text([])):
        with pytest.raises(EmbeddingNotSupported, match="bare backend"):
            call(Bare())
    from unicon.evaluation.editing.runner import check_model

    with pytest.raises(UserError, match="bare backend"):
        check_model(Bare())


# ---- ShapesWorld candidates ----------------------------------------------------------------------
def test_shapes_candidate_ratings_are_exact(world, tmp_path):
    cfg = load_world(world).config
    path = write_editscore_set(world, tmp_path / "es", n=5, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and {r["candidate"] for r in rows} <= set(CANDIDATES)
    for r in rows:
        s, t, c = (Scene.from_dict(r[k]) for k in ("source_scene", "target_scene", "edited_scene"))
        with Image.open(path.parent / r["edited_image"]) as im:
            assert parse(im, cfg) == c  # the rendered image is the rated scene
        with Image.open(path.parent / r["source_image"]) as im:
            assert parse(im, cfg) == s
        S, T, C = cells(s, cfg), cells(t, cfg), cells(c, cfg)
        R = [k for k in S if S[k] != T[k]]
        U = [k for k in S if S[k] == T[k]]
        acc = sum(C[k] == T[k] for k in R) / len(R)
        keep = sum(C[k] == S[k] for k in U) / len(U)
        assert r["ratings"] == {"editing_accuracy": acc, "content_preservation": keep, "overall": acc * keep}
        expected = {"exact": 1.0, "no_change": 0.0, "collateral": (len(U) - 1) / len(U)}
        if r["candidate"] in expected:
            assert r["ratings"]["overall"] == expected[r["candidate"]], r["id"]
        if r["candidate"] == "partial":
            assert 0 < r["ratings"]["editing_accuracy"] < 1 and r["ratings"]["content_preservation"] == 1
    again = write_editscore_set(world, tmp_path / "es2", n=5, seed=3)
    assert again.read_bytes() == path.read_bytes()  # a function of the world and the seed


# ---- the loader ----------------------------------------------------------------------------------
def _row(**kw):
    row = {"source_image": "a.png", "edited_image": "b.png", "instruction": "paint it blue",
           "ratings": {"overall": 0.5}}
    row.update(kw)
    return row


@pytest.mark.parametrize("line, message", [
    ("not json", r"data.jsonl:2: malformed JSON"),
    (json.dumps([1, 2]), r"data.jsonl:2: expected a JSON object"),
    (json.dumps(_row(instruction="")), r"data.jsonl:2: 'instruction' is missing"),
    (json.dumps({k: v for k, v in _row().items() if k != "edited_image"}), r"data.jsonl:2: 'edited_image' is missing"),
    (json.dumps(_row(ratings=[0.5])), r"data.jsonl:2: 'ratings' must be an object"),
    (json.dumps(_row(ratings={"beauty": 0.5})), r"data.jsonl:2: unknown rating key 'beauty'"),
    (json.dumps(_row(source_image="gone.png")), r"data.jsonl:2: source_image .*gone.png does not exist"),
])
def test_loader_refuses_bad_rows_naming_file_and_line(tmp_path, line, message):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    Image.new("RGB", (8, 8), "red").save(tmp_path / "b.png")
    (tmp_path / "data.jsonl").write_text(json.dumps(_row()) + "\n" + line + "\n")
    with pytest.raises(UserError, match=message):
        load_samples(tmp_path / "data.jsonl")


def test_unreadable_image_and_skipped_ratings(tmp_path):
    from unicon.evaluation.editing.runner import skipped_counts

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"not a png")
    rows = [_row(ratings={"overall": float("nan"), "visual_quality": 0.3}), _row(ratings={"overall": 1.5}),
            _row(ratings={"overall": None, "editing_accuracy": "good"}), _row(ratings={})]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    samples = load_samples(tmp_path / "data.jsonl")
    skipped = skipped_counts(samples)
    assert skipped["overall"] == {"missing": 1, "invalid": 3}
    assert skipped["editing_accuracy"] == {"missing": 3, "invalid": 1}
    assert skipped["visual_quality"] == {"missing": 3, "invalid": 0}
    with pytest.raises(UserError, match=r"data.jsonl:1: edited_image .*b.png cannot be read"):
        samples[0].image("edited")


# ---- end to end ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def export(ofa, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("editing_model") / "export"
    ofa.save_pretrained(str(path))
    return path


def _cli(*args: str) -> int:
    from unicon.evaluation.suites import suite

    return suite("editing").cli([*args, "--device", "cpu", "--logger", "none"])


def test_cli_end_to_end_tau_equals_scipy_from_the_samples_file_and_shards_merge(export, world, tmp_path, capsys):
    data = world / "editscore" / "editscore.jsonl"
    out = tmp_path / "one"
    assert _cli("--ckpt", str(export), "--data", str(data), "--out", str(out), "--own-edits", "2",
                "--batch-size", "4") == 0
    report = json.loads((out / "editing.json").read_text())
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == report["results"]["n"] == len(data.read_text().splitlines())
    assert report["model_fingerprint"] and report["eps"] == EPS
    for r in records:  # the components and the ablations are consistent per sample
        denom = r["rls"] ** 2 + EPS
        assert r["score"] == pytest.approx(r["cos_image"] * r["sim_text"] / denom, rel=1e-12)
        assert r["no_cos"] == pytest.approx(r["sim_text"] / denom, rel=1e-12)
        assert r["no_sim_text"] == pytest.approx(r["cos_image"] / denom, rel=1e-12)
        assert r["no_rls"] == pytest.approx(r["cos_image"] * r["sim_text"], rel=1e-12)
    crit = report["results"]["criteria"]
    assert crit == ["editing_accuracy", "content_preservation", "overall"]
    for key in ("score", "no_cos", "no_sim_text", "no_rls", "cos_image", "sim_text", "rls"):
        for c in crit:
            xs = [r[key] for r in records if r["ratings"].get(c) is not None]
            ys = [r["ratings"][c] for r in records if r["ratings"].get(c) is not None]
            want = kendalltau(xs, ys, variant="b").statistic
            got = report["results"]["kendall"][key][c]["tau_b"]
            assert (got is None and math.isnan(want)) or got == pytest.approx(want, abs=1e-12), (key, c)
            assert report["results"]["metrics"][f"tau_b/{key}/{c}"] == got
    assert report["results"]["skipped_ratings"]["visual_quality"] == {"missing": len(records), "invalid": 0}
    own = report["own_edits"]
    assert own["all"]["n"] == 2 and 0 <= own["all"]["exact_match"] <= 1
    assert len((out / "own_edits.jsonl").read_text().splitlines()) == 2
    for name in ("table.md", "tau_by_variant.png", "score_vs_rating.png"):
        assert (out / name).is_file()
    assert "EditingScore (tau_b)" in capsys.readouterr().out
    from unicon.report import render_html

    page = render_html(out)  # the output folder's report.html section: the tau table and both figures
    assert 'class="editing-tau"' in page and 'class="editing-own"' in page
    assert "editing/fig/tau_by_variant" in page and "editing/fig/score_vs_rating" in page

    # shards: byte-identical to one run with the same batch composition (batch size 1: a batched matmul's
    # rounding depends on the rows beside it, so other batch sizes agree to float32 rounding only)
    one = tmp_path / "one_by_one"
    assert _cli("--ckpt", str(export), "--data", str(data), "--out", str(one), "--own-edits", "2",
                "--batch-size", "1") == 0
    single = json.loads((one / "editing.json").read_text())
    sharded = tmp_path / "sharded"
    for i in range(2):
        assert _cli("--ckpt", str(export), "--data", str(data), "--out", str(sharded), "--own-edits", "2",
                    "--batch-size", "1", "--shard", f"{i}/2") == 0
    assert not (sharded / "editing.json").exists()
    assert _cli("--ckpt", str(export), "--data", str(data), "--out", str(sharded), "--own-edits", "2",
                "--batch-size", "1", "--merge") == 0
    assert (sharded / "samples.jsonl").read_bytes() == (one / "samples.jsonl").read_bytes()
    assert (sharded / "own_edits.jsonl").read_bytes() == (one / "own_edits.jsonl").read_bytes()
    merged = json.loads((sharded / "editing.json").read_text())
    assert merged["results"] == single["results"] and merged["own_edits"] == single["own_edits"]
    import standins

    for run in (out, one, sharded):
        standins.assert_strict_json(run)  # results, samples, tables, metrics: no NaN / Infinity
    batched = [json.loads(line) for line in (one / "samples.jsonl").read_text().splitlines()]
    # batch size 4 vs 1: the latents differ by float32 rounding (2^-23 relative per element, grown by the
    # encoder's reductions over d_model=32 features); cos/rls are smooth in them
    for a, b in zip(records, batched):
        for key in ("cos_image", "sim_text", "rls"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["id"], key)


def test_table_rows_flag_sets_the_rows_of_the_samples_table(world, tmp_path, capsys):
    """``--table-rows`` (generated from EditingEvalConfig, as every suite's flags) is the number of rows of
    the samples table (W&B, tables/editing_samples.jsonl); its default is the config's."""
    import standins
    from unicon.config import EditingEvalConfig
    from unicon.evaluation.suites import suite

    assert suite("editing").parser().parse_args(["--ckpt", "c", "--out", "o", "--data", "d"]).table_rows == \
        EditingEvalConfig.table_rows
    ckpt = tmp_path / "fake"
    standins.FakeModel(scale=0.5).save_pretrained(str(ckpt))
    out = tmp_path / "out"
    assert _cli("--ckpt", str(ckpt), "--data", str(world / "editscore" / "editscore.jsonl"), "--out", str(out),
                "--limit", "5", "--table-rows", "3") == 0
    capsys.readouterr()
    assert len((out / "samples.jsonl").read_text().splitlines()) == 5
    assert len((out / "tables" / "editing_samples.jsonl").read_text().splitlines()) == 3


def test_cli_refuses_a_missing_data_file_and_a_bad_flag(export, tmp_path):
    with pytest.raises(UserError, match="--data .*nope.jsonl does not exist"):
        _cli("--ckpt", str(export), "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"))
    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(UserError, match="--own-edits must be >= 0"):
        _cli("--ckpt", str(export), "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o"),
             "--own-edits", "-1")


def test_suite_is_registered():
    from unicon.evaluation.suites import suites

    assert "editing" in suites()
    assert all(c in CRITERIA for c in ("editing_accuracy", "overall"))


def test_eval_group_argv_and_callback_from_config(world, ofa, tmp_path):
    """``eval=editing``: the registry's argv for ``unicon evaluate all`` and the epoch-end callback, which
    writes the suite's files under eval/editing/epoch-<e>/ and returns tau_b per variant and criterion."""
    from types import SimpleNamespace

    from unicon import config
    from unicon.evaluation import suites
    from unicon.evaluation.callbacks import SuiteCallback

    cfg = config.compose(["eval=editing", f"data.root={world}", "eval.editing.max_samples=8"])
    assert cfg.eval.editing.enabled and not cfg.eval.cococon.enabled and not config.compose([]).eval.editing.enabled
    data = world / "editscore" / "editscore.jsonl"
    assert suites.suite("editing").argv(cfg) == [f"--data={data}", "--limit=8", "--batch-size=16", "--own-edits=0",
                                                 "--table-rows=16"]
    cb = SuiteCallback.from_config(suites.suite("editing"), cfg)
    assert len(cb.inputs.samples) == 8 and cb.config.data == str(data)
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), current_epoch=0, global_step=3, loggers=[],
                              strategy=SimpleNamespace(root_device=torch.device("cpu")), is_global_zero=True)
    metrics = cb.evaluate(trainer, ofa)
    saved = json.loads((tmp_path / "eval" / "editing" / "epoch-1" / "editing.json").read_text())
    assert saved["epoch"] == 1 and saved["results"]["n"] == 8
    assert metrics == {f"editing/{k}": v for k, v in saved["results"]["metrics"].items()}  # the CLI's names, n too
    assert "editing/n" in metrics
    assert "editing/tau_b/score/overall" in metrics
    with pytest.raises(Exception, match="editscore"):
        SuiteCallback(suites.suite("editing"),
                      config.EditingEvalConfig(data=str(tmp_path / "editscore" / "editscore.jsonl")))


def test_direction_is_compared_with_the_papers_results():
    """The paper's Tables 2-4 correlate the raw score positively with the human score (higher is better);
    the summary says, per criterion, whether a run's direction agrees, and the table says so."""
    from unicon.evaluation.editing.metrics import CORRELATED, PAPER_DIRECTION, summarize
    from unicon.evaluation.editing.runner import markdown_table

    def records(sign):
        return [{**{k: sign * float(i) for k in CORRELATED}, "ratings": {"overall": i / 4, "editing_accuracy": 0.5}}
                for i in range(5)]

    up, down = summarize(records(+1), {}), summarize(records(-1), {})
    assert PAPER_DIRECTION["direction"] == "higher score = better rating" and "+0.259" in PAPER_DIRECTION["evidence"]
    assert up["agrees_with_paper"] == {"editing_accuracy": None, "overall": True}
    assert down["agrees_with_paper"]["overall"] is False and down["score_direction"]["overall"] == "lower score = better rating"
    assert "overall: lower score = better rating (the paper's is the opposite)" in markdown_table(down)
    assert "overall: higher score = better rating (agrees with the paper)" in markdown_table(up)


# ---- the paper's Table 2 (Pearson matrix) and Table 3 (the judge baseline) -------------------------
def _table2_records(n: int = 12):
    """Records with the four components, a rating and a judge score; one non-finite score, one sample
    without an overall rating and one unparseable judge reply, so each Pearson entry has its own n."""
    rng = np.random.default_rng(0)
    recs = []
    for i in range(n):
        cos, sim, rls = float(rng.uniform(0.2, 1.0)), float(rng.uniform(-0.2, 0.6)), float(rng.uniform(0.1, 2.0))
        recs.append({"cos_image": cos, "sim_text": sim, "rls": rls, "score": cos * sim / (rls ** 2 + EPS),
                     "no_cos": sim / (rls ** 2 + EPS), "no_sim_text": cos / (rls ** 2 + EPS), "no_rls": cos * sim,
                     "ratings": {"overall": float(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])),
                                 "editing_accuracy": float(rng.uniform())},
                     "judge_score": float(rng.choice([0.0, 0.3, 0.6, 1.0])), "judge_reply": "0.6"})
    recs[3]["score"] = float("inf")
    del recs[5]["ratings"]["overall"]
    recs[7]["judge_score"], recs[7]["judge_reply"] = None, "a fine edit"
    return recs


def test_pearson_matrix_is_symmetric_with_unit_diagonal_and_equals_scipy():
    from scipy.stats import pearsonr

    from unicon.evaluation.editing.judges import describe
    from unicon.evaluation.editing.metrics import summarize
    from unicon.evaluation.editing.runner import markdown_table

    recs = _table2_records()
    results = summarize(recs, {}, judge=describe("model"))
    m = results["pearson"]
    names = m["variables"]
    assert names == ["score", "rls", "cos_image", "sim_text", "human", "judge"] and m["human"] == "overall"

    def column(name):
        if name == "human":
            return [r["ratings"].get("overall") for r in recs]
        return [r["judge_score"] if name == "judge" else r[name] for r in recs]

    for i, a in enumerate(names):
        assert m["r"][i][i] == 1.0
        for j, b in enumerate(names):
            assert m["r"][i][j] == m["r"][j][i] and m["n"][i][j] == m["n"][j][i]
            if i == j:
                continue
            pts = [(x, y) for x, y in zip(column(a), column(b))
                   if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
            want = pearsonr(*zip(*pts))
            assert m["n"][i][j] == len(pts) and m["r"][i][j] == want.statistic and m["p"][i][j] == want.pvalue
    assert m["n"][0][4] == 10  # the inf score and the missing rating left out, pairwise
    assert m["n"][4][5] == 10 and m["n"][1][2] == 12
    assert results["metrics"]["pearson/score/human"] == m["r"][0][4]
    # Table 3: Kendall tau against the Human Score of the human score, EditingScore and the judge
    t3 = results["table3"]
    human = [r["ratings"].get("overall") for r in recs]
    for key, xs in (("score", [r["score"] for r in recs]), ("judge", [r["judge_score"] for r in recs])):
        pts = [(x, y) for x, y in zip(xs, human) if x is not None and y is not None and math.isfinite(x)]
        assert t3["rows"][key]["tau_b"] == kendalltau(*zip(*pts), variant="b").statistic
        assert t3["rows"][key]["tau_c"] == kendalltau(*zip(*pts), variant="c").statistic
    assert t3["rows"]["human"]["tau_b"] == pytest.approx(1.0, abs=EPS)
    assert t3["judge"]["spec"] == "model" and t3["judge"]["failures"] == 1 and t3["judge"]["judged"] == 12
    assert results["kendall"]["judge"]["overall"] == t3["rows"]["judge"]
    table = markdown_table(results)
    assert "Table 2: Pearson's r" in table and "(-0.78)" in table and "Table 3: Kendall tau" in table
    assert "| judge score (tau_b) |" in table and "1 of 12 replies unparseable" in table


def test_without_a_judge_table3_says_why_and_the_matrix_has_the_papers_five():
    from unicon.evaluation.editing.metrics import summarize
    from unicon.evaluation.editing.runner import markdown_table

    recs = [{k: v for k, v in r.items() if not k.startswith("judge")} for r in _table2_records()]
    results = summarize(recs, {})
    assert results["pearson"]["variables"] == ["score", "rls", "cos_image", "sim_text", "human"]
    assert "judge" not in results["kendall"] and results["table3"]["rows"]["judge"] is None
    assert "GPT-based" in results["table3"]["judge"]["not_run"]
    assert "judge not run: no --judge given" in markdown_table(results)
    constant = [{**r, "sim_text": 0.5} for r in recs]  # a constant variable: r undefined, its diagonal too
    m = summarize(constant, {})["pearson"]
    assert math.isnan(m["r"][3][3]) and math.isnan(m["r"][0][3]) and m["r"][0][0] == 1.0


def test_model_judge_rates_edits_through_the_cli_and_shards_merge(world, tmp_path, capsys):
    """``--judge model``: the evaluated model is asked the edited-image prompt; replies are parsed
    strictly (failures counted), written per sample, correlated in Tables 2 and 3; shards and their
    merge give one run's results."""
    import standins
    from unicon.evaluation.alignment.prompts import parse_rating
    from unicon.evaluation.editing.judges import EDITED_ONLY_PROMPT, judge_prompt

    ckpt = tmp_path / "fake"
    standins.FakeModel(scale=0.5, answers=["0.6", "maybe", "1.0", "0.3", "0"]).save_pretrained(str(ckpt))
    data = world / "editscore" / "editscore.jsonl"
    common = ["--ckpt", str(ckpt), "--data", str(data), "--limit", "10", "--batch-size", "4", "--judge", "model"]
    assert _cli(*common, "--out", str(tmp_path / "one")) == 0
    assert "Table 3: Kendall tau" in capsys.readouterr().out
    report = json.loads((tmp_path / "one" / "editing.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "one" / "samples.jsonl").read_text().splitlines()]
    answers = ["0.6", "maybe", "1.0", "0.3", "0"]
    for r in rows:  # the stand-in answers answers[len(question) % 5]
        reply = answers[len(judge_prompt(r["instruction"], pair=False)) % 5]
        assert r["judge_reply"] == reply and r["judge_score"] == parse_rating(reply, "cf")
    t3 = report["results"]["table3"]
    assert t3["judge"]["spec"] == "model" and t3["judge"]["prompt"] == EDITED_ONLY_PROMPT
    assert t3["judge"]["failures"] == sum(r["judge_score"] is None for r in rows)
    assert report["results"]["pearson"]["variables"][-1] == "judge"
    for i in range(2):
        assert _cli(*common, "--out", str(tmp_path / "split"), "--shard", f"{i}/2") == 0
    assert _cli(*common, "--out", str(tmp_path / "split"), "--merge") == 0
    merged = json.loads((tmp_path / "split" / "editing.json").read_text())
    assert merged["results"]["table3"] == t3 and merged["results"]["pearson"] == report["results"]["pearson"]
    with pytest.raises(UserError, match="--judge 'gpt-4o'"):
        _cli(*common[:-1], "gpt-4o", "--out", str(tmp_path / "x"))


def test_vlm_edit_judge_shows_the_source_then_the_edited_image(tmp_path):
    """``--judge vlm:<dir>`` with a 1-layer Qwen2-VL: two image slots per prompt, the source and the edited
    image in that order, greedy replies equal to an independent ``generate`` on the same inputs, parsed
    strictly."""
    import standins
    from test_ureason import _reference_replies
    from unicon.evaluation.editing.judges import build_judge

    standins.qwen2_vl(tmp_path / "vlm")
    judge = build_judge(f"vlm:{tmp_path / 'vlm'}", max_new_tokens=4, batch_size=2)
    sources = [Image.new("RGB", (56, 56), c) for c in ("red", "green")]
    edited = [Image.new("RGB", (56, 56), c) for c in ("blue", "white")]
    results = judge.rate(sources, edited, ["make it blue", "make it white"])
    text = judge.build_text("make it blue")
    assert text.count("<|image_pad|>") == 2 and text.index("<|image_pad|>") < text.index("make it blue")
    inputs = judge.processor(text=[judge.build_text(i) for i in ("make it blue", "make it white")],
                             images=[sources[0], edited[0], sources[1], edited[1]], return_tensors="pt", padding=True)
    assert inputs["image_grid_thw"].shape[0] == 4  # two images per prompt
    expected = _reference_replies(judge.model, judge.tokenizer, inputs, 4)
    assert [r.reply for r in results] == [reply for reply, _ in expected]
    from unicon.evaluation.alignment.prompts import parse_rating

    assert [r.score for r in results] == [parse_rating(reply, "cf") for reply, _ in expected]
