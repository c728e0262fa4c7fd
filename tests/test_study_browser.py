"""The study pages in a real browser: Chromium (the ``chromium`` fixture of tests/conftest.py, Debian's
package, installed when missing) driven by Playwright.

Two annotators finish a 2-model study of 3 seeds (6 items: 3 understanding, 3 generation) by
clicking the ratings and dragging the rankings (one page through the rank selects instead), one of
them closes a half-filled page and comes back, and the export equals the scripted ground truth. A
page opens with no rank chosen; a ranking left untouched is not submitted.
Each section is screenshotted and must not be blank.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from test_study import CFG, ThreadServer, create, ground_truth
from unicon.study import db
from unicon.study.annotators import judge
from unicon.study.cli import export_cli


def non_blank(png: bytes) -> float:
    arr = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64)
    return float(arr.var())


DRAGS = []


def answer_page(page, base: str, use_selects: bool = False) -> dict:
    """Fill the current sample page as the scripted annotator would and return that judgement
    (each drag is counted in :data:`DRAGS`)."""
    captions = {li.get_attribute("data-letter"): li.locator(".caption").inner_text()
                for li in page.locator("#understanding .output").all()}
    prompt = page.locator("#prompt").inner_text()
    fetch = lambda src: page.request.get(base + src).body()  # noqa: E731 (same session, same token URL)
    input_png = fetch(page.locator("#understanding img.input").get_attribute("src"))
    images = {o.get_attribute("data-letter"): fetch(o.locator("img").get_attribute("src"))
              for o in page.locator("#generation .output").all()}
    want = judge(input_png, captions, prompt, images, CFG)
    for section in db.SECTIONS:
        for letter, level in want[section]["ratings"].items():
            page.check(f'input[name="{section}.rating.{letter}"][value="{level}"]')
        target = want[section]["ranking"]
        items = f'ol.ranking[data-section="{section}"] li'
        selects = [page.locator(f'select[name="{section}.rank.{L}"]').input_value() for L in target]
        assert selects == [""] * len(target), "the page must open with no rank chosen"
        dragged = len(DRAGS)
        for pos, letter in enumerate(target):
            if use_selects:
                page.select_option(f'select[name="{section}.rank.{letter}"]', str(pos + 1))
            else:
                current = [li.get_attribute("data-letter") for li in page.locator(items).all()]
                if current[pos] != letter:
                    DRAGS.append((section, letter))
                    page.locator(f'{items}[data-letter="{letter}"]').drag_to(
                        page.locator(items).nth(pos), target_position={"x": 10, "y": 2})
        if not use_selects and len(DRAGS) == dragged:  # the shown order is already right: confirm it
            page.select_option(f'select[name="{section}.rank.{target[0]}"]', "1")
        got = [li.get_attribute("data-letter") for li in page.locator(items).all()]
        assert got == target, (section, got, target)
        selects = [int(page.locator(f'select[name="{section}.rank.{L}"]').input_value()) for L in target]
        assert selects == list(range(1, len(target) + 1))
    return want


def test_two_annotators_finish_a_study_in_chromium(tmp_path, chromium):
    from playwright.sync_api import sync_playwright  # the dev extra

    kinds = ("strong", "weak")
    DRAGS.clear()
    study, tokens = create(tmp_path, kinds, annotators="2", overlap=2, n=3)
    shots = tmp_path / "shots"  # kept by pytest when the test fails
    shots.mkdir()
    with ThreadServer(study) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            for who, (name, token) in enumerate(tokens.items()):
                context = browser.new_context(viewport={"width": 1100, "height": 900})
                page = context.new_page()
                page.goto(f"{srv.url}/s/{token}")
                assert "0/3 done" in page.locator("#progress").inner_text()
                for step in range(3):
                    if who == 0 and step == 1:  # half-fill a page, close the tab, come back: same sample, nothing saved
                        sample_url = page.url
                        page.check('input[name="understanding.rating.A"][value="good"]')
                        page.close()
                        page = context.new_page()
                        page.goto(f"{srv.url}/s/{token}")
                        assert page.url == sample_url
                        assert not page.is_checked('input[name="understanding.rating.A"][value="good"]')
                        assert "1/3 done" in page.locator("#progress").inner_text()
                    if who == 1 and step == 0:  # rated but not ranked: the page is not sent, nothing is saved
                        url = page.url
                        for section in db.SECTIONS:
                            for o in page.locator(f"#{section} .output").all():
                                page.check(f'input[name="{section}.rating.{o.get_attribute("data-letter")}"]'
                                           '[value="medium"]')
                        page.click("#submit")
                        page.wait_for_timeout(500)
                        assert page.url == url
                    answer_page(page, srv.url, use_selects=(who == 1 and step == 2))
                    for section in db.SECTIONS:
                        png = page.locator(f"#{section}").screenshot()
                        (shots / f"{name}-{step}-{section}.png").write_bytes(png)
                        assert non_blank(png) > 100, f"{section} screenshot looks blank"
                    before = page.url
                    page.click("#submit")
                    page.wait_for_url(lambda u: u != before, timeout=10000)
                    page.wait_for_load_state()
                    if step < 2:
                        assert f"{step + 1}/3 done" in page.locator("#progress").inner_text()
                assert "All 3 samples are done" in page.locator("#message").inner_text()
                # a judged page shows the judgement read-only
                page.goto(f"{srv.url}/s/{token}/sample/1")
                if page.locator("#judgement").count():
                    assert page.locator("#judgement").get_attribute("data-done") == "1"
                context.close()
        finally:
            browser.close()
    assert DRAGS, "no ranking needed a drag: the test did not exercise drag-to-rank"
    assert export_cli([str(study), "--out", str(tmp_path / "export")]) == 0
    result = json.loads((tmp_path / "export" / "study.json").read_text())
    truth = ground_truth(kinds, n=3)
    assert result["judgements"] == 6
    for section in db.SECTIONS:
        for m in kinds:
            got = result["sections"][section]["models"][m]
            assert got["shares"] == pytest.approx(truth[section][m]["shares"])
            assert got["mean_rank"] == pytest.approx(truth[section][m]["mean_rank"])
        assert result["sections"][section]["agreement"]["kendall_w"] == pytest.approx(1.0)
