"""The instruction rows (data_builders/shapes_instruct.py) and the run's headline table: values computed by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_builders.shapes_instruct import mc_rows, rating_answer  # noqa: E402
from unicon.evaluation.realunify.prompts import LETTERS  # noqa: E402
from unicon.report import headline_table  # noqa: E402
from unicon.worlds.shapes import WorldConfig  # noqa: E402


@pytest.mark.parametrize("share, value", [(1.0, "1.0"), (0.99, "0.6"), (0.75, "0.6"), (0.6, "0.6"), (0.45, "0.6"),
                                          (0.4, "0.3"), (0.3, "0.3"), (0.25, "0.3"), (0.15, "0.3"), (0.1, "0"),
                                          (0.0, "0")])
def test_rating_answer_is_the_nearest_value_and_one_only_when_every_statement_holds(share, value):
    # nearest of 0 / 0.3 / 0.6 below 1: |0.45 - 0.6| = 0.15 < |0.45 - 0.3|; 0.15 is a tie, to the higher
    assert rating_answer(share) == value


def test_mc_rows_put_the_worlds_answer_under_the_target_letter():
    cfg = WorldConfig()
    vqa = [{"qtype": "color", "target": "red", "text": "what color is the circle?", "image": "a.png", "scene": {}},
           {"qtype": "count", "target": "two", "text": "how many objects are there?", "image": "b.png", "scene": {}},
           {"qtype": "relation", "target": "yes", "text": "is the red circle left of the blue square?",
            "image": "c.png", "scene": {}},
           {"qtype": "relation", "target": "below", "text": "where is the red circle relative to the blue square?",
            "image": "d.png", "scene": {}}]
    rows = list(mc_rows(vqa, cfg, seed=0, n=10))
    assert [r["image"] for r in rows] == ["a.png", "b.png", "d.png"]  # a yes/no question has no four options
    for i, (row, source) in enumerate(zip(rows, [vqa[0], vqa[1], vqa[3]])):
        assert row["target"] == LETTERS[i % 4]
        options = [line[3:] for line in row["text"].splitlines() if line[:3] in ("A. ", "B. ", "C. ", "D. ")]
        assert len(set(options)) == 4 and options[LETTERS.index(row["target"])] == source["target"]
        assert f"Question: {source['text']}" in row["text"]


def test_headline_table_reports_first_last_and_change():
    table = headline_table({"cococon/vqa/C_1": [(10, 87.0), (20, 90.0), (30, 84.5)],
                            "cococon/vqa/rho": [(10, 0.5), (30, 0.75)],
                            "cococon/t2i/C_1": [(10, 86.0), (30, 86.0)]})
    lines = table.splitlines()
    assert lines[0] == "CocoCon at the first and last of 3 epoch-end evaluations:"
    vqa, t2i = lines[2].split(), lines[3].split()
    assert vqa == ["vqa", "87.0", "84.5", "-2.5", "0.500", "0.750", "+0.250"]
    assert t2i[:4] == ["t2i", "86.0", "86.0", "+0.0"] and all(math.isnan(float(x)) for x in t2i[4:])
    assert all(len(line) == len(lines[1]) for line in lines[2:])  # columns stay apart
    assert headline_table({"train/loss": [(1, 1.0)]}) is None
