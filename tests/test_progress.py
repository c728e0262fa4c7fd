"""unicon.progress: rich bars on a terminal, plain lines in logs (SLURM), rank zero only."""

from __future__ import annotations

import io
import re

import pytest

import unicon.progress as progress
from unicon.progress import progress_mode, track


class Clock:
    """A clock that moves only when told (``tick`` seconds per step)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress, "_clock", c)
    return c


def _plain(items: list, clock, tick: float = 1.0, sized: bool = True, **kw) -> list[str]:
    out = io.StringIO()
    got = []
    for x in track(items if sized else iter(items), "demo", mode="plain", stream=out, **kw):
        clock.now += tick
        got.append(x)
    assert got == list(items)
    return out.getvalue().splitlines()


def test_plain_lines_every_few_seconds_and_at_the_end(clock):
    lines = _plain(list(range(20)), clock, unit="batches", every_seconds=5)
    assert lines == [
        "demo: 5/20 batches (25%), 0:00:05 elapsed, ~0:00:15 left",
        "demo: 10/20 batches (50%), 0:00:10 elapsed, ~0:00:10 left",
        "demo: 15/20 batches (75%), 0:00:15 elapsed, ~0:00:05 left",
        "demo: 20/20 batches (100%) in 0:00:20",
    ]
    # items of 100 s, a line once 150 s have passed since the last one
    lines = _plain(list(range(10)), clock, tick=100.0, every_seconds=150)
    assert [re.match(r"demo: (\d+)/10", ln).group(1) for ln in lines] == ["2", "4", "6", "8", "10"]


def test_a_loop_shorter_than_every_seconds_writes_one_line(clock):
    assert _plain(list(range(12)), clock, unit="batches") == ["demo: 12/12 batches (100%) in 0:00:12"]


def test_plain_unknown_total_and_early_stop(clock):
    lines = _plain(list(range(5)), clock, tick=40.0, sized=False, every_seconds=100)
    assert lines == ["demo: 3, 0:02:00 elapsed", "demo: 5 in 0:03:20"]
    out = io.StringIO()
    for i in track(range(10), "demo", mode="plain", stream=out):
        if i == 3:
            break
    assert out.getvalue().splitlines() == ["demo: stopped at 3/10 after 0:00:00"]


def test_a_loop_inside_another_reports_nothing(clock):
    """One stage, one report: drift's batches inside a generation of its chains write no line of their
    own, and a loop after the stage reports again."""
    out = io.StringIO()
    for _ in track(range(3), "chains", mode="plain", stream=out, unit="generations"):
        clock.now += 1.0
        assert list(track(range(4), "batches", mode="plain", stream=out)) == [0, 1, 2, 3]
    assert list(track(range(2), "after", mode="plain", stream=out)) == [0, 1]
    assert out.getvalue().splitlines() == ["chains: 3/3 generations (100%) in 0:00:03", "after: 2/2 (100%) in 0:00:00"]


def test_rich_bar_on_a_terminal():
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    assert list(track(range(7), "drift text-first", mode="rich", console=console)) == list(range(7))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "drift text-first" in text and "7/7" in text


def test_mode_from_environment_and_other_ranks_stay_silent(monkeypatch, clock):
    monkeypatch.setenv("UNICON_PROGRESS", "off")
    assert progress_mode() == "off"
    out = io.StringIO()
    assert list(track(range(3), "x", stream=out)) == [0, 1, 2] and out.getvalue() == ""
    monkeypatch.setenv("UNICON_PROGRESS", "plain")
    monkeypatch.setenv("RANK", "1")
    assert list(track(range(3), "x", stream=out)) == [0, 1, 2] and out.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    assert list(track(range(3), "x", stream=out)) == [0, 1, 2] and out.getvalue() == "x: 3/3 (100%) in 0:00:00\n"
    monkeypatch.setenv("UNICON_PROGRESS", "auto")  # pytest captures stdout: not a terminal
    assert progress_mode() == "plain"
    monkeypatch.setenv("UNICON_PROGRESS", "bars")
    with pytest.raises(ValueError, match="UNICON_PROGRESS must be one of auto, rich, plain, off, got 'bars'"):
        progress_mode()
