"""Every JSON and JSONL file a run writes is strict JSON (RFC 8259): no ``NaN`` / ``Infinity`` token,
nothing a strict parser refuses (:func:`standins.assert_strict_json`).

The training run is tests/test_wandb_logging.py's (``runs``: ``make demo``'s ``experiment=shapes_demo``
shrunk, with its epoch-end CocoCon, drift and UReason evaluations, resumed for a third epoch, then
``unicon evaluate cococon|drift|ureason``), built once per session and shared with the tests that
read it. The other suites' runs are scanned where their tests make them:
``test_realunify::test_cli_writes_results_refuses_stepwise_without_editing_and_merges_shards``,
``test_alignment::test_cli_scores_taus_and_merges_shards``,
``test_editing_score::test_cli_end_to_end_tau_equals_scipy_from_the_samples_file_and_shards_merge`` and
``test_shapes_suite::test_evaluate_all_runs_the_shapes_tasks_group_with_its_settings``.
"""

from __future__ import annotations

import pytest
from test_wandb_logging import runs  # noqa: F401  (the session's run, built once)

import standins


def test_the_scan_names_the_file_and_line_of_each_non_json_token(tmp_path):
    (tmp_path / "ok.json").write_text('{"note": "NaN in a string is text", "x": [1.5, null]}')
    (tmp_path / "report.json").write_text('{\n  "a": 1,\n  "b": NaN\n}\n')
    (tmp_path / "rows.jsonl").write_text('{"step": 0}\n{"step": 1, "loss": -Infinity}\n')
    (tmp_path / "cut.jsonl").write_text('{"step": 0}\n{"step": 1, "lo\n')
    with pytest.raises(AssertionError) as err:
        standins.assert_strict_json(tmp_path)
    lines = str(err.value).splitlines()[1:]
    assert [line.split(": ", 1)[0] for line in lines] == [
        f"{tmp_path / 'cut.jsonl'}:2", f"{tmp_path / 'report.json'}:3", f"{tmp_path / 'rows.jsonl'}:2"]


@pytest.mark.slow
def test_a_demo_like_run_and_its_evaluations_write_strict_json_only(runs):  # noqa: F811
    """The run folder (config, checkpoints' neighbours, ``metrics.jsonl``, ``tables/``, every epoch's
    ``eval/<suite>/``, the W&B offline files) and the standalone evaluations' ``--out`` folders."""
    root = runs["run_dir"].parents[1]  # <tmp>/wandb: runs/<name>, export, cococon, drift, ureason
    assert {"cococon", "drift", "ureason", "export"} <= {p.name for p in root.iterdir()}
    standins.assert_strict_json(root)
