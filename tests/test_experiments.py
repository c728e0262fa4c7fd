"""``unicon experiment table2``: runs, resumption, and the paired statistics it reports."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from unicon.experiments import table2


def test_paired_interval_is_scipys_paired_t_interval():
    k = np.array([61.0, 58.5, 63.0, 60.0])
    m = np.array([64.0, 60.5, 63.5, 65.0])
    got = table2.paired_interval(m - k)
    ci = stats.ttest_rel(m, k).confidence_interval(0.95)
    assert got["n"] == 4
    assert got["mean"] == pytest.approx(float(np.mean(m - k)), rel=1e-12)
    assert got["low"] == pytest.approx(ci.low, rel=1e-9) and got["high"] == pytest.approx(ci.high, rel=1e-9)
    one = table2.paired_interval([2.0])
    assert one["mean"] == 2.0 and math.isnan(one["low"])  # no interval from one seed
    assert table2.paired_interval([math.nan])["n"] == 0


def test_run_metrics_reads_the_last_cococon_row_and_names_a_run_without_one(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "train/loss": 1.0},
        {"step": 2, "cococon/vqa/C_1": 50.0, "cococon/vqa/rho": 0.1},
        {"step": 3, "cococon/vqa/C_1": 70.0, "cococon/vqa/rho": 0.3},
        {"step": 4, "train/loss": 0.5},
    ]) + "\n")
    assert table2.run_metrics(f) == {"cococon/vqa/C_1": 70.0, "cococon/vqa/rho": 0.3}
    f.write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    with pytest.raises(Exception, match="no CocoCon evaluation"):
        table2.run_metrics(f)


def test_training_rho_rise_is_last_epoch_mean_minus_first_and_is_tabulated(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"step": 9, "epoch": 0, "train/rho/vqa/ema": 0.1, "train/rho/vqa/epoch_mean": 0.1},
        {"step": 149, "epoch": 0, "train/rho/vqa/epoch_mean": 0.40, "train/rho/t2i/epoch_mean": 0.50},
        {"step": 299, "epoch": 1, "train/rho/vqa/epoch_mean": 0.55, "train/rho/t2i/epoch_mean": float("nan")},
        {"step": 439, "epoch": 2, "train/rho/vqa/epoch_mean": 0.60, "train/rho/t2i/epoch_mean": 0.40},
        {"step": 449, "epoch": 2, "train/rho/vqa/epoch_mean": 0.70, "train/rho/t2i/epoch_mean": 0.45},
    ]) + "\n")
    got = table2.training_rho(f)
    assert got["vqa/first"] == 0.40 and got["vqa/last"] == 0.70 and got["vqa/rise"] == pytest.approx(0.30)
    assert got["t2i/rise"] == pytest.approx(-0.05) and "localization/rise" not in got
    k = table2.summarize_run({"cococon/vqa/C_1": 80.0}, {"vqa/rise": 0.01})
    m = table2.summarize_run({"cococon/vqa/C_1": 82.0}, got)
    assert math.isnan(k["train_rho/t2i/rise"]) and m["train_rho/vqa/rise"] == pytest.approx(0.30)
    md = table2.markdown(table2.summarize({"K": {0: k}, "M": {0: m}}), [0], [])
    assert "VQA train ρ rise" in md and "| M | 0.300 |" in md and "| M − K | +0.290 |" in md


def test_probe_columns_appear_only_for_runs_with_probe_words():
    flat = {"cococon/vqa/C_1": 80.0, "cococon/localization/C_1": 60.0, "cococon/t2i/C_1": 70.0}
    plain = table2.summarize_run(flat)
    assert "probe/caption/acc@1" not in plain and plain["mean/C_1"] == pytest.approx(70.0)
    probed = table2.summarize_run({**flat, "cococon/probe/num_samples": 40, "cococon/probe/caption/acc@1": 55.0,
                                   "cococon/probe/vqa/C_1": 50.0, "cococon/probe/t2i/C_1": 70.0})
    assert probed["probe/caption/acc@1"] == 55.0
    assert probed["probe/mean/C_1"] == pytest.approx(60.0)  # the probed tasks present (no localization)
    md = table2.markdown(table2.summarize({"K": {0: probed}, "M": {0: probed}}), [0], [])
    assert "probe caption acc@1" in md and "55.0" in md
    assert "probe" not in table2.markdown(table2.summarize({"K": {0: plain}}), [0], [])
    per_word = {"cococon/probe/star/num_samples": 9, "cococon/probe/star/caption/acc@1": 80.0,
                "cococon/probe/star/vqa/C_1": 40.0, "cococon/probe/star/vqa/acc@1": 30.0}
    k_run = table2.summarize_run({**flat, "cococon/probe/num_samples": 9, **per_word})
    m_run = table2.summarize_run({**flat, "cococon/probe/num_samples": 9, **per_word, "cococon/probe/star/vqa/C_1": 55.0})
    assert k_run["probe/star/vqa/C_1"] == 40.0 and k_run["probe/star/caption/acc@1"] == 80.0
    md = table2.markdown(table2.summarize({"K": {0: k_run, 1: k_run}, "M": {0: m_run, 1: m_run}}), [0, 1], [])
    assert "| star | K | 80.0 ± 0.0 | 40.0 ± 0.0 |" in md
    assert "| star | M − K | +0.0 [+0.0, +0.0] | +15.0 [+15.0, +15.0] |" in md


def test_table2_trains_each_method_and_seed_then_resumes_from_its_records(tiny_shapes_world, tmp_path):
    """Real (tiny) runs of K and M for two seeds; the summary equals an independent computation
    from the recorded metrics; a second call trains nothing."""
    overrides = [
        "trainer=cpu", "logger=csv", f"data.root={tiny_shapes_world}", f"output_dir={tmp_path / 'runs'}",
        "init_from=null", "data.batch_size=4", "data.contrast_batch_size=2", "data.max_contrast=3",
        "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.enable_progress_bar=false",
        "eval.cococon.max_samples=4", "optim.lr=1e-3",
    ]
    out = tmp_path / "table2"
    summary = table2.run_experiment(out, [0, 1], ["K", "M"], overrides)
    records = {(r["method"], r["seed"]): r for r in json.loads((out / "table2.json").read_text())["runs"]}
    assert set(records) == {("K", 0), ("M", 0), ("K", 1), ("M", 1)}
    assert all(r["global_step"] == 2 for r in records.values())
    # one W&B group for the experiment's runs (a group in the overrides would be kept instead)
    assert all(f"logger.group={table2.run_prefix(out)}" in r["args"] for r in records.values())

    def mean_c1(method, seed):
        flat = records[(method, seed)]["cococon"]
        return np.mean([flat[f"cococon/{t}/C_1"] for t in table2.TASKS])

    k = np.array([mean_c1("K", s) for s in (0, 1)])
    m = np.array([mean_c1("M", s) for s in (0, 1)])
    assert summary["methods"]["K"]["mean/C_1"]["mean"] == pytest.approx(k.mean())
    assert summary["methods"]["M"]["mean/C_1"]["std"] == pytest.approx(np.std(m, ddof=1))
    diff = summary["paired_vs_K"]["M"]["mean/C_1"]
    assert diff["mean"] == pytest.approx((m - k).mean())
    if np.ptp(m - k) > 0:
        ci = stats.ttest_rel(m, k).confidence_interval(0.95)
        assert (diff["low"], diff["high"]) == pytest.approx((ci.low, ci.high))
    md = (out / "table2.md").read_text()
    assert "| K |" in md and "| M − K |" in md and "VQA C₁" in md
    assert (out / "table2.png").stat().st_size > 0
    import matplotlib

    backend = matplotlib.get_backend()
    matplotlib.use("svg")  # a caller's backend other than Agg, which the plot must leave alone
    try:
        table2.plot(summary, tmp_path / "again.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    assert (tmp_path / "again.png").stat().st_size > 0

    def must_not_train(args):
        raise AssertionError(f"a recorded run was trained again: {args}")

    # a record whose args name no group (or another one) is the same training: reused
    record = out / "runs" / "K-seed1.json"
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "args": [a for a in kept["args"] if not a.startswith("logger.group=")]}))
    again = table2.run_experiment(out, [0, 1], ["K", "M"], overrides, train_fn=must_not_train)
    assert again["paired_vs_K"]["M"]["mean/C_1"]["mean"] == pytest.approx(diff["mean"])
    from unicon.errors import UserError

    with pytest.raises(UserError, match="K-seed0.json was trained with other arguments"):
        table2.run_experiment(out, [0], ["K"], [*overrides, "optim.lr=1e-2"], train_fn=must_not_train)


def test_table2_cli_refuses_unknown_methods_and_bad_overrides(tmp_path):
    from unicon.errors import UserError

    with pytest.raises(UserError, match="not key=value"):
        table2.cli(["--out", str(tmp_path), "--", "oops"])
    with pytest.raises(UserError, match="unknown method 'Q'"):
        table2.run_experiment(tmp_path, [0], ["Q"], [])


def _claiming_train(args):
    """``unicon train`` without the training: claims its run folder as a run does (``overwrite=true``
    deletes the folder's files) and logs one CocoCon row."""
    from unicon.training.run import compose_run
    from unicon.training.run_folder import claim_run_dir, release_run_dir

    cfg = compose_run(args, announce=False)
    release_run_dir(claim_run_dir(cfg))
    run_dir = Path(cfg.output_dir) / cfg.name
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "cococon/vqa/C_1": 50.0}) + "\n")
    return {"run_dir": str(run_dir), "global_step": 1}


def test_table2_runs_of_two_experiments_never_share_or_delete_a_run_folder(tmp_path):
    """Two experiments whose --out share a basename get their own run folders; an existing run folder
    the experiment did not create is refused and kept, its own interrupted run is retrained."""
    from unicon.errors import UserError

    overrides = [f"output_dir={tmp_path / 'runs'}"]
    a, b = tmp_path / "a" / "exp", tmp_path / "b" / "exp"
    table2.run_experiment(a, [0], ["K"], overrides, train_fn=_claiming_train)
    table2.run_experiment(b, [0], ["K"], overrides, train_fn=_claiming_train)
    run_a, run_b = (Path(json.loads((o / "runs" / "K-seed0.json").read_text())["run_dir"]) for o in (a, b))
    assert run_a != run_b and (run_a / "metrics.jsonl").is_file() and (run_b / "metrics.jsonl").is_file()

    c = tmp_path / "c" / "exp"
    other = tmp_path / "runs" / f"{table2.run_prefix(c)}_K_seed0"  # another run that has c's run name
    other.mkdir()
    (other / "last.ckpt").write_text("weights")
    with pytest.raises(UserError, match=f"run folder {re.escape(str(other))} exists and was not created by this"):
        table2.run_experiment(c, [0], ["K"], overrides, train_fn=_claiming_train)
    assert (other / "last.ckpt").read_text() == "weights"

    (a / "runs" / "K-seed0.json").unlink()  # a's run was interrupted before its record: a retrains it
    (run_a / "stale.txt").write_text("old")
    table2.run_experiment(a, [0], ["K"], overrides, train_fn=_claiming_train)
    assert not (run_a / "stale.txt").exists() and (run_b / "metrics.jsonl").is_file()


def test_table2_out_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    from unicon.cli import main as unicon_main

    out = tmp_path / "exp"
    out.write_text("not a folder")
    assert unicon_main(["experiment", "table2", "--seeds", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"unicon: error: --out {out} exists and is not a folder"]
