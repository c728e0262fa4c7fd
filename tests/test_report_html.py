"""``unicon report RUN_DIR``'s ``report.html``, rendered in a real browser (headless Chromium).

The run is tests/test_wandb_logging.py's (``runs``: two epochs of ``experiment=shapes_demo`` with
epoch-end CocoCon, drift and UReason evaluation, resumed for a third epoch), reported by the real
CLI. Chromium comes from the ``chromium`` fixture of tests/conftest.py (Debian's package, installed
when missing), as for every browser test.

The page is checked three ways:

* statically: every image is a ``data:image/...`` URI, every link an in-page ``#anchor``; no
  script, no stylesheet link, no ``http(s)://`` reference;
* in the browser: a copy of the page with a probe script appended (the report itself has no
  script) is loaded with ``--dump-dom``; on the ``load`` event (all images decoded) the probe
  writes, per section, its images, the images whose ``naturalWidth`` is 0 (broken), its figures
  and tables, and the cells of the trend tables, as JSON into the DOM that Chromium prints;
* visually: a screenshot of the page (saved in the test's tmp dir and copied to
  ``/tmp/report_screenshot.png``) must be the window's size and not blank.
"""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_wandb_logging import STEPS_PER_EPOCH, runs  # noqa: F401  (the session's run, built once)

from unicon.report import collect
from unicon.report import sections as report_sections

EPOCHS = 3  # two epochs, then one more after the resume
WINDOW = (1280, 4000)
SCREENSHOT_COPY = Path("/tmp/report_screenshot.png")

# appended to a copy of the page: the report itself carries no script
PROBE = """<script>
window.addEventListener("load", () => {
  const sections = {};
  for (const s of document.querySelectorAll("main > section")) {
    const imgs = [...s.querySelectorAll("img")];
    const keys = {};
    for (const el of s.querySelectorAll("[data-key]")) keys[el.dataset.key] = (keys[el.dataset.key] || 0) + 1;
    sections[s.id] = {
      title: s.querySelector("h2") ? s.querySelector("h2").textContent : null,
      images: imgs.length,
      broken: imgs.filter(i => !i.complete || i.naturalWidth === 0).map(i => i.alt),
      keys: keys,
      tables: [...s.querySelectorAll("table")].map(t => t.className),
    };
  }
  const tables = {};
  for (const t of document.querySelectorAll("table")) {
    tables[t.className] = [...t.querySelectorAll("tbody tr")].map(r => [...r.cells].map(c => c.textContent.trim()));
  }
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify({sections, tables, images: document.images.length});
  document.body.appendChild(pre);
});
</script>"""


def _headless(chromium: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    """One headless Chromium run; its profile in ``tmp`` (root needs --no-sandbox)."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):  # noqa: F811
    """``(run_dir, report.html path)``, written by ``unicon report RUN_DIR``."""
    from unicon.report import cli

    import matplotlib

    run_dir = runs["run_dir"]
    backend = matplotlib.get_backend()
    matplotlib.use("svg")  # a caller's backend other than Agg: the report draws on Figure objects and leaves it alone
    try:
        assert cli([str(run_dir)]) == 0
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    page = run_dir / "report.html"
    assert page.is_file() and (run_dir / "report.md").is_file()
    return run_dir, page


@pytest.mark.slow
def test_report_html_is_self_contained(report):
    _, page = report
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"<script|<link|<iframe|<object|@import|url\(", text, re.I)
    srcs = re.findall(r'\ssrc="([^"]*)"', text)
    hrefs = re.findall(r'\shref="([^"]*)"', text)
    assert srcs and all(s.startswith(("data:image/png;base64,", "data:image/jpeg;base64,")) for s in srcs)
    assert hrefs and all(h.startswith("#") for h in hrefs), [h for h in hrefs if not h.startswith("#")]
    assert not re.search(r"https?://", text)
    assert (page.parent / "report.md").read_text().count("(report.html)") == 1


@pytest.mark.slow
def test_report_html_renders_every_section_in_chromium(report, chromium, tmp_path):
    run_dir, page = report
    # --- the DOM after load, with the probe's findings
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = _headless(chromium, "--virtual-time-budget=20000", "--dump-dom", probe_page.as_uri(), tmp=tmp_path).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, f"the probe did not run (no load event?); DOM starts:\n{dom[:1500]}"
    probe = json.loads(html.unescape(found.group(1)))
    sections = probe["sections"]

    # every section, in order, with its title; no broken image anywhere
    assert list(sections) == [sid for sid, _ in report_sections()]
    assert {sid: s["title"] for sid, s in sections.items()} == dict(report_sections())
    assert probe["images"] == len(re.findall(r"<img\s", page.read_text(encoding="utf-8")))
    broken = {sid: s["broken"] for sid, s in sections.items() if s["broken"]}
    assert not broken, f"images that did not decode: {broken}"

    def keys(sid: str) -> dict[str, int]:
        return sections[sid]["keys"]

    assert "headline" in sections["summary"]["tables"]
    # the training-batch ρ per task (the run trains with the rank loss), the training curves, the headline curves
    assert keys("training") == {"training/rho": 1, "training/curves": 1, "evaluation/curves": 1}
    # each suite: its figures at every epoch end, its tables, its sample images
    for name in ("consistency_by_k", "consistency_vs_accuracy"):
        assert keys("cococon")[f"cococon/fig/{name}"] == EPOCHS
    for name in ("drift_curves", "mgg_heatmap", "strips"):
        assert keys("drift")[f"drift/fig/{name}"] == EPOCHS
    assert {"cococon-trend", "cococon-ck", "cococon-samples"} <= set(sections["cococon"]["tables"])
    assert {"drift-trend", "drift-mcd", "drift-strips"} <= set(sections["drift"]["tables"])
    assert {"ureason-trend", "ureason-acc", "ureason-side"} <= set(sections["ureason"]["tables"])
    assert keys("ureason")["ureason/fig/settings_by_category"] == EPOCHS
    tables = probe["tables"]
    # the last evaluation's tables (earlier epochs' are folded in <details>, also in the DOM)
    assert keys("drift")["drift/strip"] >= len(tables["drift-strips"]) >= 1
    side = tables["ureason-side"]
    assert len(side) >= 1 and all(keys("ureason")[f"ureason/s{k}"] >= len(side) for k in (1, 2, 3))
    assert all(row[-3:] and {cell for cell in row[-3:]} <= {"yes", "no"} for row in side)

    # the trend tables hold what metrics.jsonl logged at each epoch end (printed with 4 significant digits)
    series = collect(run_dir)
    for table, column, key in (("cococon-trend", 1, "cococon/vqa/C_1"), ("drift-trend", 1, "drift/MCD_avg"),
                               ("ureason-trend", 1, "ureason/acc_s1")):
        rows = tables[table]
        assert [r[0] for r in rows] == [f"epoch {e}" for e in range(1, EPOCHS + 1)], (table, rows)
        logged = {step: v for step, v in series[key]}
        for epoch, row in enumerate(rows, 1):
            value = logged[epoch * STEPS_PER_EPOCH]
            assert math.isclose(float(row[column]), value, rel_tol=5e-4, abs_tol=1e-12), (table, epoch, row, value)

    # the config section is config.yaml, flattened
    config = dict((r[0], r[1]) for r in tables["config"])
    assert config["experiment"] == "shapes_demo" and config["name"] == "wb"
    assert json.loads(config["trainer.limit_train_batches"]) == STEPS_PER_EPOCH

    # --- a screenshot: the window's size, and not blank
    from PIL import Image, ImageStat

    shot = tmp_path / "report.png"
    _headless(chromium, f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}", page.as_uri(), tmp=tmp_path)
    with Image.open(shot) as im:
        assert im.size == WINDOW
        gray = im.convert("L")
        assert ImageStat.Stat(gray).stddev[0] > 10 and len(gray.getcolors(256) or []) > 16, "blank screenshot"
    try:
        shutil.copyfile(shot, SCREENSHOT_COPY)
    except OSError:  # a read-only /tmp: the one in the test's tmp dir is enough
        pass


# ---------------------------------------------------------------------------------------------
# Other folders (no browser needed)
# ---------------------------------------------------------------------------------------------
def _section(page: str, sid: str) -> str:
    found = re.search(rf'<section id="{sid}">(.*?)</section>', page, re.S)
    assert found, f"no section {sid}"
    return found.group(1)


def test_report_of_a_standalone_evaluation_folder(runs):  # noqa: F811
    """``unicon report`` on ``unicon evaluate cococon --out DIR``'s folder: its results, figures and
    samples in the CocoCon section; the other suites say they were not evaluated."""
    from unicon.report import cli

    out = runs["export"].parent / "cococon"
    assert cli([str(out)]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    cococon = _section(page, "cococon")
    for name in ("consistency_by_k", "consistency_vs_accuracy"):
        assert cococon.count(f'data-key="cococon/fig/{name}"') == 1
    assert 'class="cococon-ck"' in cococon and 'class="cococon-samples"' in cococon
    for sid in ("drift", "ureason"):
        assert f"No {sid} evaluation in this run" in _section(page, sid)
    assert "No config.yaml in this folder" in _section(page, "config")


def test_report_without_evaluations_thumbnails_and_bad_files(tmp_path):
    """A run without evaluation: every section, the empty ones saying so; a COCO-size sample image
    is inlined as a thumbnail; an unreadable results.json is an error naming the file."""
    import base64
    import io

    from PIL import Image

    from unicon.config import compose, to_yaml
    from unicon.errors import UserError
    from unicon.evaluation.html import THUMB_SIDE
    from unicon.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(compose(["name=plain", "eval=none"])))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / (s + 1)}) + "\n"
                                               for s in range(5)))
    write_report(run)
    page = (run / "report.html").read_text(encoding="utf-8")
    assert [m for m in re.findall(r'<section id="(\w+)">', page)] == [sid for sid, _ in report_sections()]
    assert page.count('data-key="training/curves"') == 1 and 'data-key="evaluation/curves"' not in page
    for sid in ("cococon", "drift", "ureason"):
        assert f"No {sid} evaluation in this run" in _section(page, sid)
    config = _section(page, "config")
    assert "<td>name</td>" in config and "<td>loss.lambda_</td>" in config

    # a CocoCon evaluation with a 640x480 sample photo
    ev = run / "eval" / "cococon" / "epoch-1"
    ev.mkdir(parents=True)
    (ev / "results.json").write_text(json.dumps({"vqa": {"C_k": {"1": 50.0}, "acc@k": {"1": 40.0}, "rho": 0.5,
                                                         "num_samples": 2}, "max_k": 1}))
    (run / "tables" / "cococon_samples").mkdir(parents=True)
    Image.new("RGB", (640, 480), "orange").save(run / "tables" / "cococon_samples" / "photo.png")
    (run / "tables" / "cococon_samples.jsonl").write_text(json.dumps(
        {"step": 4, "image": "cococon_samples/photo.png", "id": 7, "caption": "a <b>cat</b> & a dog",
         "vqa_consistent": True}) + "\n")
    write_report(run)
    cococon = _section((run / "report.html").read_text(encoding="utf-8"), "cococon")
    assert "a &lt;b&gt;cat&lt;/b&gt; &amp; a dog" in cococon  # text is escaped
    (uri,) = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="sample 7"', cococon)
    with Image.open(io.BytesIO(base64.b64decode(uri))) as im:
        assert im.size == (THUMB_SIDE, THUMB_SIDE * 480 // 640)

    (ev / "results.json").write_text("{not json")
    with pytest.raises(UserError, match=re.escape(str(ev / "results.json"))):
        write_report(run)


def _figure_series(page: str, key: str) -> dict:
    """The plotted points of the figure ``key`` (its ``data-series`` attribute)."""
    found = re.findall(rf'<figure data-key="{re.escape(key)}" data-series="([^"]*)">', page)
    assert len(found) == 1, f"{len(found)} figures {key}"
    return json.loads(html.unescape(found[0]))


def test_report_against_a_baseline_run(tmp_path, capsys):
    """``unicon report RUN --baseline RUN_K``: per task, C_1, rho and acc@1 at each run's last epoch end
    and their difference, then captioning's acc@1 and a probed word's rows, printed and at the top of report.md and report.html, with both runs' curves
    there (C_1 per evaluation, the training-batch ρ where logged); a baseline without CocoCon is an
    error naming it."""
    from unicon import cli
    from unicon.report import render_html

    def run(name, values, train=()):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": 10 * (e + 1), **{f"cococon/{t}/{m}": v[e] for (t, m), v in values.items()}} for e in range(2)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*train, *rows]))
        return folder

    # the training-batch rho: M's consistency steps log it, K (cross-entropy only) none
    rho = [{"step": 5, "train/loss": 1.0, "train/rho/vqa/ema": 0.25}, {"step": 15, "train/rho/vqa/ema": 0.5}]
    m = run("M", {("vqa", "C_1"): [80.0, 90.0], ("vqa", "rho"): [0.5, 0.75], ("t2i", "C_1"): [70.0, 60.0],
                  ("t2i", "rho"): [0.25, 0.25], ("vqa", "acc@1"): [90.0, 95.0], ("caption", "acc@1"): [80.0, 85.0],
                  ("probe/purple/caption", "acc@1"): [40.0, 70.0], ("probe/purple/vqa", "C_1"): [50.0, 75.0]}, rho)
    k = run("K", {("vqa", "C_1"): [80.0, 85.0], ("vqa", "rho"): [0.5, 0.5], ("t2i", "C_1"): [70.0, 62.5],
                  ("t2i", "rho"): [0.25, 0.5], ("vqa", "acc@1"): [90.0, 93.0], ("caption", "acc@1"): [80.0, 80.0],
                  ("probe/purple/caption", "acc@1"): [40.0, 50.0], ("probe/purple/vqa", "C_1"): [50.0, 60.0]})
    assert cli.main(["report", str(m), "--baseline", str(k), "--brief"]) == 0
    out = capsys.readouterr().out
    assert "M (run) against K (base)" in out
    assert re.search(r"^vqa\s+90\.0\s+85\.0\s+\+5\.0\s+0\.750\s+0\.500\s+\+0\.250\s+95\.0\s+93\.0\s+\+2\.0$", out, re.M), out
    assert re.search(r"^t2i\s+60\.0\s+62\.5\s+-2\.5\s+0\.250\s+0\.500\s+-0\.250(\s+-){3}$", out, re.M), out
    assert re.search(r"^caption(\s+-){6}\s+85\.0\s+80\.0\s+\+5\.0$", out, re.M), out
    assert re.search(r"^purple/caption(\s+-){6}\s+70\.0\s+50\.0\s+\+20\.0$", out, re.M), out
    assert re.search(r"^purple/vqa\s+75\.0\s+60\.0\s+\+15\.0(\s+-){6}$", out, re.M), out
    assert "localization" not in out  # logged by neither run
    assert "## Against the baseline run" in (m / "report.md").read_text()
    summary = _section((m / "report.html").read_text(encoding="utf-8"), "summary")
    assert '<td class="num ok">5</td>' in summary and '<td class="num bad">-2.5</td>' in summary
    assert summary.index('class="comparison"') < summary.index('data-key="comparison/C_1"')
    assert _figure_series(summary, "comparison/C_1") == {
        "vqa": {"this run": [[10, 80.0], [20, 90.0]], "baseline": [[10, 80.0], [20, 85.0]]},
        "t2i": {"this run": [[10, 70.0], [20, 60.0]], "baseline": [[10, 70.0], [20, 62.5]]}}
    assert _figure_series(summary, "comparison/rho") == {"vqa": {"this run": [[5, 0.25], [15, 0.5]]}}
    assert "The baseline logged no training-batch ρ" in summary and "only this run's is plotted" in summary
    # a baseline that logs it too: both runs' rho on one plot, no note
    with (k / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 15, "train/rho/vqa/ema": 0.125, "train/rho/t2i/ema": float("nan")}) + "\n")
    summary = _section(render_html(m, baseline=k), "summary")
    assert _figure_series(summary, "comparison/rho") == {
        "vqa": {"this run": [[5, 0.25], [15, 0.5]], "baseline": [[15, 0.125]]}, "t2i": {"baseline": [[15, None]]}}
    assert "no training-batch ρ" not in summary
    plain = run("plain", {})
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    assert cli.main(["report", str(m), "--baseline", str(plain)]) != 0
    assert f"baseline {plain}: no CocoCon" in capsys.readouterr().err


def test_report_py_names_no_suite():
    """report.py reaches every suite through the registry: its sections, headline, end-of-training
    table and baseline comparison are the suites' own (e.g. CocoCon's, in its report module)."""
    from unicon import report
    from unicon.evaluation.suites import suites

    source = Path(report.__file__).read_text(encoding="utf-8")
    assert "cococon" not in source.lower()
    named = [name for name in suites() if f'"{name}"' in source or f"{name}/" in source]
    assert not named, f"report.py names {named}"
