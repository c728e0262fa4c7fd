"""The human cross-consistency study: create, the HTTP app (security, concurrency, restart), export.

The drift outputs are written with the drift runner's own layout and writers from ShapesWorld scenes
whose captions and images are right, half right or wrong in known ways, so the scripted annotators'
answers, and therefore the study's shares, ranks and agreement, are known before the study runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from unicon.errors import UserError
from unicon.evaluation.drift.runner import ChainLayout, atomic_write, csv_bytes, png_bytes
from unicon.study import db
from unicon.study.annotators import ScriptedAnnotator, judge, rank, rate_caption, rate_image
from unicon.study.app import create_app, engine_counts
from unicon.study.assign import balanced_assignment
from unicon.study.cli import create_cli, export_cli
from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, render
from unicon.worlds.shapes_text import describe_scene

CFG = WorldConfig()
#: drift metrics of the fixture models (strong > mid > weak on every metric)
METRICS = {"strong": {"MCD_avg": 0.9, "MGG": 0.8, "GenEval": 0.9},
           "mid": {"MCD_avg": 0.7, "MGG": 0.5, "GenEval": 0.6},
           "weak": {"MCD_avg": 0.4, "MGG": 0.2, "GenEval": 0.5}}


# ---------------------------------------------------------------------------------------------------------
# Fixtures: drift output folders
# ---------------------------------------------------------------------------------------------------------
def make_scenes(n: int, seed: int = 0) -> list[Scene]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(2, 4))
        cells = rng.choice(CFG.grid * CFG.grid, size=k, replace=False)
        out.append(Scene(tuple(ShapeObject(str(rng.choice(CFG.shapes)), str(rng.choice(CFG.color_names)),
                                           int(c) // CFG.grid, int(c) % CFG.grid) for c in cells)))
    return out


def drop_one(scene: Scene) -> Scene:
    return Scene(scene.objects[:-1])


def recolour(scene: Scene) -> Scene:
    colors = CFG.color_names
    return Scene(tuple(ShapeObject(o.shape, colors[(colors.index(o.color) + 1) % len(colors)], o.row, o.col)
                       for o in scene.objects))


def model_outputs(kind: str, k: int, scene: Scene) -> tuple[str, Scene]:
    """(first caption of the input image, scene of the first generated image) of a fixture model.
    strong: exact (except seed 0); mid: exact caption, an object missing from the image;
    weak: a caption missing an object, an image with wrong colours. No two models give equal outputs."""
    if kind == "strong":
        if k == 0:  # its one mistake: wrong colours in the caption, an extra object missing from the image
            return describe_scene(recolour(scene)), recolour(drop_one(scene))
        return describe_scene(scene), scene
    if kind == "mid":  # another exact phrasing: equal outputs would make the ranking a coin flip
        phrasings = (describe_scene(scene, np.random.default_rng(s)) for s in range(100))
        return next(p for p in phrasings if p != describe_scene(scene)), drop_one(scene)
    return describe_scene(drop_one(scene)), recolour(scene)


def write_drift_run(out: Path, kind: str, scenes: list[Scene], first: int = 0) -> Path:
    """A ``unicon evaluate drift --out`` folder: chains (generations 0 and 1) under ``mcd/`` and ``drift.json``
    (``scenes`` are seeds ``first``, ``first + 1``, ...)."""
    layout = ChainLayout(out / "mcd")
    ids = [f"seed-{k:02d}" for k in range(first, first + len(scenes))]
    prompts, captions = [], []
    for k, (i, scene) in enumerate(zip(ids, scenes), start=first):
        caption, gen_scene = model_outputs(kind, k, scene)
        prompts.append((layout.row_name(i), describe_scene(scene)))
        captions.append((layout.row_name(i), caption))
        atomic_write(layout.image_file("image-first", 0, i), png_bytes(render(scene, CFG)))
        atomic_write(layout.image_file("text-first", 1, i), png_bytes(render(gen_scene, CFG, seed=k)))
    atomic_write(layout.captions_file("text-first", 0), csv_bytes(prompts))
    atomic_write(layout.captions_file("image-first", 1), csv_bytes(captions))
    m = METRICS[kind]
    report = {"MCD_avg": m["MCD_avg"], "MGG": m["MGG"], "mgg": {"per_generation": {"1": {"overall": m["GenEval"]}}}}
    atomic_write(out / "drift.json", json.dumps(report).encode())
    return out


def make_runs(tmp: Path, kinds=("strong", "mid", "weak"), n: int = 6) -> list[str]:
    scenes = make_scenes(n)
    return [f"{k}={write_drift_run(tmp / 'drift' / k, k, scenes)}" for k in kinds]


def ground_truth(kinds, n: int = 6) -> dict:
    """Per section and model: G/M/P shares and mean rank that noiseless scripted annotators must give."""
    scenes = make_scenes(n)
    ratings = {s: {m: [] for m in kinds} for s in db.SECTIONS}
    ranks = {s: {m: [] for m in kinds} for s in db.SECTIONS}
    for k, scene in enumerate(scenes):
        prompt = describe_scene(scene)
        caps = {m: model_outputs(m, k, scene)[0] for m in kinds}
        imgs = {m: png_bytes(render(model_outputs(m, k, scene)[1], CFG, seed=k)) for m in kinds}
        assert len(set(caps.values())) == len(set(imgs.values())) == len(kinds), "equal outputs: a coin-flip rank"
        for section, contents, levels in (
                ("understanding", caps, {m: rate_caption(c, scene, CFG) for m, c in caps.items()}),
                ("generation", imgs, {m: rate_image(b, prompt, CFG) for m, b in imgs.items()})):
            order = rank(levels, contents)
            for m in kinds:
                ratings[section][m].append(levels[m])
                ranks[section][m].append(order.index(m) + 1)
    return {s: {m: {"shares": {lv: ratings[s][m].count(lv) / n for lv in db.LEVELS},
                    "mean_rank": float(np.mean(ranks[s][m]))} for m in kinds} for s in db.SECTIONS}


def create(tmp: Path, kinds=("strong", "mid", "weak"), annotators="6", overlap=2, n=6, capsys=None) -> tuple[Path, dict]:
    runs = make_runs(tmp, kinds, n)
    study = tmp / "study"
    assert create_cli([*runs, "--out", str(study), "--annotators", annotators, "--overlap", str(overlap)]) == 0
    tokens = dict(line.split("\t") for line in (study / db.TOKENS_FILE).read_text().splitlines())
    return study, {name: link.rsplit("/", 1)[1] for name, link in tokens.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn in a thread on a free 127.0.0.1 port."""

    def __init__(self, study: Path):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(db.study_url(study)), host="127.0.0.1",
                                                    port=self.port, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def rows(study: Path) -> dict:
    """Row counts and every judgement's content: what a refused request must leave unchanged."""
    engine = db.engine_for(db.study_url(study))
    with engine.connect() as conn:
        judged = sorted(tuple(r) for r in conn.execute(sa.select(db.judgements_t.c.assignment_id,
                                                                  db.judgements_t.c.payload)))
    return {"counts": engine_counts(engine), "judgements": judged}


# ---------------------------------------------------------------------------------------------------------
# create
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,people,overlap", [(6, 6, 2), (7, 3, 2), (10, 4, 3), (1, 2, 2), (5, 5, 5), (13, 6, 1)])
def test_balanced_assignment(n, people, overlap):
    plan = balanced_assignment(n, people, overlap, seed=3)
    assert all(len(a) == overlap and len(set(a)) == overlap for a in plan)
    load = np.bincount([p for a in plan for p in a], minlength=people)
    assert load.max() - load.min() <= 1 and load.sum() == n * overlap


def test_create_stores_hashed_tokens_and_masks_models(tmp_path, capsys):
    study, tokens = create(tmp_path)
    out = capsys.readouterr().out
    assert len(tokens) == 6 and all(t in out for t in tokens.values())
    assert all(len(t) >= 43 for t in tokens.values())  # 32 random bytes, URL-safe base64
    assert stat.S_IMODE((study / db.TOKENS_FILE).stat().st_mode) == 0o600
    raw = (study / db.DB_FILE).read_bytes()
    assert not any(t.encode() in raw for t in tokens.values())
    engine = db.engine_for(db.study_url(study))
    with engine.connect() as conn:
        per = conn.execute(sa.select(db.assignments_t.c.annotator_id, sa.func.count())
                           .group_by(db.assignments_t.c.annotator_id)).all()
        per_sample = conn.execute(sa.select(sa.func.count(sa.distinct(db.assignments_t.c.annotator_id)))
                                  .group_by(db.assignments_t.c.sample_id)).scalars().all()
        orders = [json.loads(o) for o in conn.execute(sa.select(db.assignments_t.c.order_json)).scalars()]
    assert sorted(c for _, c in per) == [2] * 6 and per_sample == [2] * 6
    assert len({tuple(o["generation"]) for o in orders}) > 1  # orders are randomised per instance
    from starlette.testclient import TestClient

    client = TestClient(create_app(db.study_url(study)))
    token = next(iter(tokens.values()))
    page = client.get(f"/s/{token}", follow_redirects=True)
    assert page.status_code == 200 and "Output A" in page.text and "Output C" in page.text
    assert not any(f"{m}=" in page.text or f">{m}<" in page.text or str(tmp_path / "drift" / m) in page.text
               for m in ("strong", "mid", "weak")), "a model name leaked into the page"
    assert "http://" not in page.text.replace("http://127.0.0.1", "") and "https://" not in page.text  # no CDN
    assert page.headers["referrer-policy"] == "no-referrer"


def test_create_refuses_bad_inputs(tmp_path):
    runs = make_runs(tmp_path, ("strong", "weak"), 3)
    with pytest.raises(UserError, match="at least two"):
        create_cli([runs[0], "--out", str(tmp_path / "s1")])
    with pytest.raises(UserError, match="not a folder"):
        create_cli([runs[0], f"x={tmp_path / 'nope'}", "--out", str(tmp_path / "s1")])
    with pytest.raises(UserError, match="needs at least 3 annotators"):
        create_cli([*runs, "--out", str(tmp_path / "s1"), "--annotators", "2", "--overlap", "3"])
    other = write_drift_run(tmp_path / "other", "mid", make_scenes(3, seed=9))
    with pytest.raises(UserError, match="same seeds"):
        create_cli([runs[0], f"other={other}", "--out", str(tmp_path / "s2")])
    (tmp_path / "drift" / "weak" / "mcd" / "image-first" / "gen-1.csv").unlink()
    with pytest.raises(UserError, match="gen-1.csv not found"):
        create_cli([*runs, "--out", str(tmp_path / "s3")])
    assert create_cli([runs[0], f"strong2={tmp_path / 'drift' / 'strong'}", "--out", str(tmp_path / "s4")]) == 0
    with pytest.raises(UserError, match="already holds a study"):
        create_cli([runs[0], f"strong2={tmp_path / 'drift' / 'strong'}", "--out", str(tmp_path / "s4")])
    with pytest.raises(UserError, match="not found"):
        export_cli([str(tmp_path / "missing")])


# ---------------------------------------------------------------------------------------------------------
# The app: security and validation (in process)
# ---------------------------------------------------------------------------------------------------------
def test_security_and_validation_write_nothing(tmp_path):
    from starlette.testclient import TestClient

    study, tokens = create(tmp_path, ("strong", "weak"), annotators="3", n=3)
    client = TestClient(create_app(db.study_url(study)))
    (a_name, a), (b_name, b) = list(tokens.items())[:2]
    auth = {"Authorization": f"Bearer {a}"}
    mine = set()
    engine = db.engine_for(db.study_url(study))
    with engine.connect() as conn:
        ids = {n: {q["sample_id"] for q in db.queue(conn, db.annotator_for_token(conn, t)["id"])}
               for n, t in tokens.items()}
    mine, theirs = ids[a_name], ids[b_name] - ids[a_name]
    assert theirs, "the fixture needs a sample of b's that a does not have"
    sid, other = min(mine), min(theirs)
    good = {s: {"ratings": {"A": "good", "B": "poor"}, "ranking": ["A", "B"]} for s in db.SECTIONS}
    before = rows(study)
    checks = [
        (client.get(f"/api/samples/{sid}"), 401),
        (client.get(f"/api/samples/{sid}", headers={"Authorization": "Bearer nope"}), 403),
        (client.get(f"/s/{'x' * 43}/sample/{sid}"), 403),
        (client.get(f"/api/samples/{other}", headers=auth), 404),
        (client.get(f"/s/{a}/sample/{other}"), 404),
        (client.get(f"/s/{a}/sample/{other}/input.png"), 404),
        (client.get(f"/api/samples/{other}/gen/A.png", headers=auth), 404),
        (client.get("/api/samples/99999", headers=auth), 404),
        (client.post(f"/api/samples/{other}", headers=auth, json=good), 404),
        (client.post(f"/api/samples/{sid}", json=good), 401),
        (client.post(f"/api/samples/{sid}", headers=auth,
                     json={**good, "generation": {"ratings": good["generation"]["ratings"], "ranking": ["A", "A"]}}), 400),
        (client.post(f"/api/samples/{sid}", headers=auth,
                     json={**good, "understanding": {"ratings": good["understanding"]["ratings"],
                                                     "ranking": ["A", "B", "C"]}}), 400),
        (client.post(f"/api/samples/{sid}", headers=auth,
                     json={**good, "understanding": {"ratings": {"A": "great", "B": "poor"}, "ranking": ["A", "B"]}}), 400),
        (client.post(f"/api/samples/{sid}", headers=auth,
                     json={**good, "understanding": {"ratings": {"A": "good"}, "ranking": ["A", "B"]}}), 400),
        (client.post(f"/api/samples/{sid}", headers={**auth, "Content-Type": "application/json"}, content=b"{not json"), 400),
        (client.post(f"/api/samples/{sid}", headers={**auth, "Content-Type": "application/json"},
                     content=b'{"pad": "' + b"x" * (70 * 1024) + b'"}'), 413),
        (client.post(f"/api/samples/{sid}", headers={**auth, "Content-Type": "text/plain"}, content=b"hi"), 415),
        (client.post(f"/api/samples/{sid}", headers={**auth, "Content-Type": "application/json"},
                     content=b"[" * 30000 + b"]" * 30000), 400),
        (client.post(f"/api/samples/{sid}", headers=auth, json=[good]), 400),
    ]
    for response, code in checks:
        assert response.status_code == code, (response.request.method, response.request.url, response.text)
        assert response.headers["content-type"].startswith("text/html") or "error" in response.json()
    bad = client.post(f"/api/samples/{sid}", headers=auth, json={**good, "generation": {
        "ratings": good["generation"]["ratings"], "ranking": ["A", "A"]}})
    assert "permutation" in bad.json()["error"]
    assert rows(study) == before
    first = client.post(f"/api/samples/{sid}", headers=auth, json=good)
    assert first.status_code == 201
    after_first = rows(study)
    replay = client.post(f"/api/samples/{sid}", headers=auth, json=good)
    assert replay.status_code == 200 and replay.json()["status"] == "duplicate"
    changed = {**good, "generation": {"ratings": {"A": "poor", "B": "good"}, "ranking": ["B", "A"]}}
    conflict = client.post(f"/api/samples/{sid}", headers=auth, json=changed)
    assert conflict.status_code == 409 and conflict.json()["judgement"] == good
    assert rows(study) == after_first
    assert client.get("/api/progress", headers=auth).json() == {"done": 1, "assigned": len(mine)}
    # the page's plain form (no script): ranks by selects
    form = {f"{s}.rating.{L}": "medium" for s in db.SECTIONS for L in "AB"}
    form.update({f"{s}.rank.A": "2" for s in db.SECTIONS} | {f"{s}.rank.B": "1" for s in db.SECTIONS})
    nxt = sorted(mine - {sid})[0]
    r = client.post(f"/s/{a}/sample/{nxt}", data={**form, "generation.rank.B": "2"}, follow_redirects=False)
    assert r.status_code == 400 and "ranks must be" in r.text
    r = client.post(f"/s/{a}/sample/{nxt}", data=form, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/s/{a}"
    assert client.get(f"/api/samples/{nxt}", headers=auth).json()["judgement"]["generation"]["ranking"] == ["B", "A"]


def test_double_submit_race_keeps_the_first(tmp_path):
    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", n=4)
    token = next(iter(tokens.values()))
    with ThreadServer(study) as srv:
        bot = ScriptedAnnotator(srv.url, token)
        sid = bot.get_json("/api/next")["sample"]
        payloads = [{s: {"ratings": {"A": lv, "B": "poor"}, "ranking": ["A", "B"]} for s in db.SECTIONS}
                    for lv in ("good", "medium")] * 4
        barrier = threading.Barrier(len(payloads))

        def post(p):
            barrier.wait()
            return bot.request("POST", f"/api/samples/{sid}", p)

        with ThreadPoolExecutor(len(payloads)) as pool:
            results = list(pool.map(post, payloads))
    codes = sorted(c for c, _ in results)
    assert codes.count(201) == 1 and set(codes) <= {200, 201, 409}
    winner = json.loads(next(body for c, body in results if c == 201))["judgement"]
    for (c, body), p in zip(results, payloads):
        assert c == (201 if p == winner and json.loads(body)["status"] == "created" else 200 if p == winner else 409)
    engine = db.engine_for(db.study_url(study))
    with engine.connect() as conn:
        stored = conn.execute(sa.select(db.judgements_t.c.payload)).scalars().all()
    assert [json.loads(s) for s in stored] == [winner]


# ---------------------------------------------------------------------------------------------------------
# Whole studies over HTTP
# ---------------------------------------------------------------------------------------------------------
def test_six_concurrent_annotators_match_ground_truth(tmp_path):
    kinds = ("strong", "mid", "weak")
    study, tokens = create(tmp_path, kinds, annotators="6", overlap=2, n=6)
    with ThreadServer(study) as srv:
        bots = [ScriptedAnnotator(srv.url, t, seed=i) for i, t in enumerate(tokens.values())]
        barrier = threading.Barrier(len(bots))

        def work(bot):
            barrier.wait()
            return bot.run()

        with ThreadPoolExecutor(len(bots)) as pool:
            done = list(pool.map(work, bots))
    assert done == [2] * 6
    counts = rows(study)["counts"]
    assert counts["judgements"] == counts["assignments"] == 12
    assert export_cli([str(study), "--out", str(tmp_path / "export")]) == 0
    result = json.loads((tmp_path / "export" / "study.json").read_text())
    truth = ground_truth(kinds)
    for section in db.SECTIONS:
        got = result["sections"][section]
        for m in kinds:
            assert got["models"][m]["n"] == 12
            assert got["models"][m]["shares"] == pytest.approx(truth[section][m]["shares"])
            assert got["models"][m]["mean_rank"] == pytest.approx(truth[section][m]["mean_rank"])
        assert got["agreement"]["krippendorff_alpha"] == pytest.approx(1.0)
        assert got["agreement"]["kendall_w"] == pytest.approx(1.0)
        assert got["agreement"]["kendall_tau_pairwise"] == pytest.approx(1.0)
        # strong < mid < weak in human mean rank; higher metric = better -> rho = -1
        assert got["spearman"]["MCD_avg"]["rho"] == pytest.approx(-1.0)
    assert truth["generation"]["strong"]["shares"]["good"] == pytest.approx(5 / 6)
    assert result["consistency"]["strong"]["consistent"] == pytest.approx(5 / 6)  # seed 0: poor caption, medium image
    html = (tmp_path / "export" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "<script" not in html
    assert "alt='fidelity heatmap'" in html  # Fig. 14, from study.json's consistency counts
    from unicon.study.export import fidelity_matrix

    strong = fidelity_matrix(result["consistency"]["strong"])
    assert np.trace(strong) == pytest.approx(100 * 5 / 6) and strong.sum() == pytest.approx(100.0)


def test_noisy_study_alpha_and_spearman_equal_the_packages(tmp_path):
    import krippendorff
    from scipy.stats import spearmanr

    kinds = ("strong", "mid", "weak")
    study, tokens = create(tmp_path, kinds, annotators="4", overlap=3, n=6)
    with ThreadServer(study) as srv:
        for i, t in enumerate(tokens.values()):
            ScriptedAnnotator(srv.url, t, noise=0.35, seed=10 + i).run()
    assert export_cli([str(study)]) == 0
    result = json.loads((study / "study.json").read_text())
    engine = db.engine_for(db.study_url(study))
    with engine.connect() as conn:
        judged = db.all_judgements(conn)
    names = sorted({r["annotator"] for r in judged})
    for section in db.SECTIONS:
        units = sorted({(r["sample"], r["model"]) for r in judged if r["section"] == section})
        matrix = np.full((len(names), len(units)), np.nan)
        for r in judged:
            if r["section"] == section:
                matrix[names.index(r["annotator"]), units.index((r["sample"], r["model"]))] = \
                    {"poor": 0, "medium": 1, "good": 2}[r["rating"]]
        expected = krippendorff.alpha(reliability_data=matrix, level_of_measurement="ordinal")
        got = result["sections"][section]
        assert got["agreement"]["krippendorff_alpha"] == pytest.approx(expected, abs=1e-12)
        assert got["agreement"]["krippendorff_alpha"] < 1.0  # the noise shows
        human = [got["models"][m]["mean_rank"] for m in kinds]
        rho = spearmanr(human, [METRICS[m]["MCD_avg"] for m in kinds]).statistic
        assert got["spearman"]["MCD_avg"]["rho"] == pytest.approx(rho, abs=1e-12)


def test_server_killed_mid_study_keeps_every_judgement(tmp_path):
    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", overlap=2, n=4)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}

    def start():
        proc = subprocess.Popen([sys.executable, "-m", "unicon.study", "serve", str(study), "--port", str(port)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
                return proc
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.time() < deadline, "server did not start"
                time.sleep(0.1)

    url = f"http://127.0.0.1:{port}"
    proc = start()
    try:
        bots = [ScriptedAnnotator(url, t) for t in tokens.values()]
        assert [b.run(limit=2) for b in bots] == [2, 2]
        before = rows(study)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert rows(study) == before and before["counts"]["judgements"] == 4
        proc = start()
        assert [b.get_json("/api/progress") for b in bots] == [{"done": 2, "assigned": 4}] * 2
        assert [b.run() for b in bots] == [2, 2]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert rows(study)["counts"]["judgements"] == 8


def test_judge_rubric():
    scene = make_scenes(1, seed=4)[0]
    assert rate_caption(describe_scene(scene), scene, CFG) == "good"
    assert rate_caption(describe_scene(drop_one(scene)), scene, CFG) == "medium"
    assert rate_caption(describe_scene(recolour(scene)), scene, CFG) == "poor"
    assert rate_caption("a purple elephant", scene, CFG) == "poor"
    assert rate_image(b"not a png", describe_scene(scene), CFG) == "poor"
    payload = judge(png_bytes(render(scene, CFG)), {"A": describe_scene(drop_one(scene)), "B": describe_scene(scene)},
                    describe_scene(scene), {"A": png_bytes(render(scene, CFG)), "B": png_bytes(render(recolour(scene), CFG))})
    assert payload["understanding"] == {"ratings": {"A": "medium", "B": "good"}, "ranking": ["B", "A"]}
    assert payload["generation"] == {"ratings": {"A": "good", "B": "poor"}, "ranking": ["A", "B"]}


def test_wandb_table_only_with_an_active_run(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from unicon.study.cli import serve_cli
    from unicon.study.export import compute, log_wandb

    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", n=2)
    result = compute(db.engine_for(db.study_url(study)))
    assert result["judgements"] == 0 and result["sections"]["generation"]["models"]["strong"]["mean_rank"] is None
    assert export_cli([str(study)]) == 0 and "n/a" in (study / "report.html").read_text()  # nothing judged yet
    logged = []
    fake = SimpleNamespace(run=None, Table=lambda columns, data: ("table", columns, data), log=logged.append)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert log_wandb(result) is False and not logged
    fake.run = object()
    assert log_wandb(result) is True
    kind, columns, data = logged[0]["study/models"]
    assert columns[:3] == ["model", "section", "n"] and len(data) == 4
    with pytest.raises(UserError, match="not found"):
        serve_cli([str(tmp_path / "missing")])


def test_sharded_drift_output_reads_like_one_run(tmp_path):
    from unicon.study.inputs import read_run

    scenes = make_scenes(4)
    whole = read_run("w", write_drift_run(tmp_path / "one", "mid", scenes))
    # the same chains as `--shard i/2` writes them: OUT/mcd/rank-<r>, each with its own seeds
    (tmp_path / "sharded" / "mcd").mkdir(parents=True)
    for r, first in enumerate((0, 2)):
        part = write_drift_run(tmp_path / f"part{r}", "mid", scenes[first:first + 2], first=first)
        (part / "mcd").rename(tmp_path / "sharded" / "mcd" / f"rank-{r}")
    (tmp_path / "one" / "drift.json").rename(tmp_path / "sharded" / "drift.json")  # the merge's report
    sharded = read_run("s", tmp_path / "sharded")
    for field in ("prompts", "inputs", "captions", "images"):
        assert getattr(sharded, field) == getattr(whole, field), field


# ---------------------------------------------------------------------------------------------------------
# Inputs that are refused, and the server's files, content types, port and shutdown
# ---------------------------------------------------------------------------------------------------------
def test_runs_on_other_seed_sets_are_refused_unless_common_seeds(tmp_path, capsys):
    scenes = make_scenes(5)
    full = write_drift_run(tmp_path / "full", "strong", scenes)
    part = write_drift_run(tmp_path / "part", "weak", scenes[:3])
    with pytest.raises(UserError, match=r"full \(.*full\) and part \(.*part\) hold other seeds: "
                                        r"2 only in full \('seed-03', 'seed-04'\).*--common-seeds"):
        create_cli([f"full={full}", f"part={part}", "--out", str(tmp_path / "s1")])
    assert not (tmp_path / "s1").exists()
    assert create_cli([f"full={full}", f"part={part}", "--out", str(tmp_path / "s2"), "--common-seeds"]) == 0
    assert "study: 3 samples" in capsys.readouterr().out


def test_a_seed_missing_from_a_captions_file_is_an_error(tmp_path):
    """A seed whose caption row is missing from ``image-first/gen-1.csv`` is an error naming the file and
    the seed, as a missing image is (it used to drop the seed from the study)."""
    runs = make_runs(tmp_path, ("strong", "weak"), 3)
    layout = ChainLayout(tmp_path / "drift" / "weak" / "mcd")
    captions = layout.captions("image-first", 1)
    del captions["seed-01"]
    atomic_write(layout.captions_file("image-first", 1),
                 csv_bytes([(layout.row_name(i), c) for i, c in captions.items()]))
    with pytest.raises(UserError, match=re.escape(f"{layout.captions_file('image-first', 1)}: no row for seed "
                                                  "'seed-01'")):
        create_cli([*runs, "--out", str(tmp_path / "s")])


def test_an_image_that_does_not_decode_is_refused(tmp_path):
    runs = make_runs(tmp_path, ("strong", "weak"), 3)
    layout = ChainLayout(tmp_path / "drift" / "weak" / "mcd")
    for path in (layout.image_file("text-first", 1, "seed-02"), layout.image_file("image-first", 0, "seed-01")):
        good = path.read_bytes()
        path.write_bytes(b"<script>alert(1)</script>")
        with pytest.raises(UserError, match=re.escape(f"{path}: not a PNG image")):
            create_cli([*runs, "--out", str(tmp_path / "s")])
        path.write_bytes(good)


def test_a_missing_drift_json_is_refused(tmp_path):
    runs = make_runs(tmp_path, ("strong", "weak"), 3)
    report = tmp_path / "drift" / "weak" / "drift.json"
    report.unlink()
    with pytest.raises(UserError, match=re.escape(f"{report} not found")):
        create_cli([*runs, "--out", str(tmp_path / "s")])


def test_study_database_and_its_wal_files_are_owner_only(tmp_path):
    from starlette.testclient import TestClient

    old = os.umask(0o022)
    try:
        study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", n=2)
        bot = TestClient(create_app(db.study_url(study)))
        auth = {"Authorization": f"Bearer {next(iter(tokens.values()))}"}
        sid = bot.get("/api/next", headers=auth).json()["sample"]
        good = {s: {"ratings": {"A": "good", "B": "poor"}, "ranking": ["A", "B"]} for s in db.SECTIONS}
        assert bot.post(f"/api/samples/{sid}", headers=auth, json=good).status_code == 201
    finally:
        os.umask(old)
    files = [study / db.DB_FILE, study / f"{db.DB_FILE}-wal", study / f"{db.DB_FILE}-shm"]
    assert all(f.is_file() for f in files)
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: "0o600" for f in files}


def test_media_types_are_case_insensitive(tmp_path):
    from starlette.testclient import TestClient

    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", n=2)
    client = TestClient(create_app(db.study_url(study)))
    token = next(iter(tokens.values()))
    auth = {"Authorization": f"Bearer {token}"}
    with db.engine_for(db.study_url(study)).connect() as conn:
        first, second = [q["sample_id"] for q in db.queue(conn, db.annotator_for_token(conn, token)["id"])]
    good = {s: {"ratings": {"A": "good", "B": "poor"}, "ranking": ["A", "B"]} for s in db.SECTIONS}
    r = client.post(f"/api/samples/{first}", headers={**auth, "Content-Type": "Application/JSON; charset=UTF-8"},
                    content=json.dumps(good).encode())
    assert r.status_code == 201, r.text
    form = {f"{s}.rating.{L}": "medium" for s in db.SECTIONS for L in "AB"}
    form.update({f"{s}.rank.A": "1" for s in db.SECTIONS} | {f"{s}.rank.B": "2" for s in db.SECTIONS})
    from urllib.parse import urlencode

    r = client.post(f"/s/{token}/sample/{second}", content=urlencode(form).encode(), follow_redirects=False,
                    headers={"Content-Type": "Application/X-WWW-Form-URLencoded"})
    assert r.status_code == 303, r.text


def test_a_busy_port_is_one_line_before_serving(tmp_path, capsys):
    from unicon.study.cli import serve_cli

    study, _ = create(tmp_path, ("strong", "weak"), annotators="2", n=2)
    capsys.readouterr()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=rf"127\.0\.0\.1:{port} is in use .*--port"):
            serve_cli([str(study), "--port", str(port)])
    assert "serving" not in capsys.readouterr().out


def test_an_out_that_is_a_file_is_one_line(tmp_path):
    runs = make_runs(tmp_path, ("strong", "weak"), 2)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match=re.escape(f"--out {f} exists and is not a directory")):
        create_cli([*runs, "--out", str(f)])
    assert create_cli([*runs, "--out", str(tmp_path / "study")]) == 0
    with pytest.raises(UserError, match=re.escape(f"--out {f} exists and is not a directory")):
        export_cli([str(tmp_path / "study"), "--out", str(f)])


def test_ctrl_c_checkpoints_the_wal_into_the_database_file(tmp_path):
    """After Ctrl-C every judgement is in ``study.sqlite`` itself: a copy of that one file holds them."""
    import shutil
    import sqlite3

    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", overlap=2, n=3)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "unicon.study", "serve", str(study), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/", timeout=1).read()
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.time() < deadline, "server did not start"
                time.sleep(0.1)
        assert [ScriptedAnnotator(url, t).run(limit=2) for t in tokens.values()] == [2, 2]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    wal = study / f"{db.DB_FILE}-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    copy = tmp_path / "copy" / db.DB_FILE
    copy.parent.mkdir()
    shutil.copy(study / db.DB_FILE, copy)
    with sqlite3.connect(copy) as conn:
        assert conn.execute("SELECT count(*) FROM judgements").fetchone()[0] == 4


# ---------------------------------------------------------------------------------------------------------
# Assignment design, the ranking rule, statistics at small n
# ---------------------------------------------------------------------------------------------------------
def test_assignment_rotates_annotator_pairs():
    from itertools import combinations

    from unicon.study.assign import pair_counts

    for n, every in ((15, 1), (30, 2)):  # 6 annotators, overlap 2: 15 pairs, each shares the same number
        plan = balanced_assignment(n, 6, 2, seed=0)
        assert set(pair_counts(plan, 6).values()) == {every}
        assert set(np.bincount([p for a in plan for p in a], minlength=6)) == {n * 2 // 6}
    plan = balanced_assignment(6, 6, 2, seed=0)  # the docs' example: not 3 fixed disjoint pairs
    pairs = {tuple(sorted(a)) for a in plan}
    assert len(pairs) == 6
    reach, todo = {0}, [0]  # every annotator is linked to every other through shared samples
    while todo:
        p = todo.pop()
        for q in {q for pair in pairs if p in pair for q in pair} - reach:
            reach.add(q)
            todo.append(q)
    assert reach == set(range(6))
    for people, k in ((5, 2), (7, 3)):
        counts = pair_counts(balanced_assignment(len(list(combinations(range(people), k))), people, k, seed=1), people)
        assert max(counts.values()) - min(counts.values()) <= 1 and min(counts.values()) >= 1


def test_ranking_must_agree_with_ratings_and_be_chosen(tmp_path):
    from starlette.testclient import TestClient

    from unicon.study.ranking import ranking_contradiction

    assert ranking_contradiction({"A": "good", "B": "good", "C": "poor"}, ["B", "A", "C"]) is None
    assert "Output B is rated good" in ranking_contradiction({"A": "poor", "B": "good"}, ["A", "B"])
    assert ranking_contradiction({"A": "medium", "B": "good", "C": "good"}, ["B", "A", "C"]) is not None
    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", n=2)
    client = TestClient(create_app(db.study_url(study)))
    token = next(iter(tokens.values()))
    auth = {"Authorization": f"Bearer {token}"}
    sid = client.get("/api/next", headers=auth).json()["sample"]
    page = client.get(f"/s/{token}/sample/{sid}")
    assert page.text.count('<option value="" selected>') == 4 and "required" in page.text  # no rank pre-chosen
    before = rows(study)
    contradicts = {s: {"ratings": {"A": "poor", "B": "good"}, "ranking": ["A", "B"]} for s in db.SECTIONS}
    r = client.post(f"/api/samples/{sid}", headers=auth, json=contradicts)
    assert r.status_code == 400 and "rank better-rated outputs first" in r.json()["error"]
    untouched = {f"{s}.rating.{L}": "medium" for s in db.SECTIONS for L in "AB"}
    untouched.update({f"{s}.rank.{L}": "" for s in db.SECTIONS for L in "AB"})
    r = client.post(f"/s/{token}/sample/{sid}", data=untouched, follow_redirects=False)
    assert r.status_code == 400 and "give every output a rank" in r.text
    assert rows(study) == before


def test_spearman_withheld_below_three_models_and_exact_p():
    from itertools import permutations

    from scipy.stats import spearmanr

    from unicon.study.export import spearman

    two = spearman([1.2, 1.8], [0.9, 0.4])
    assert two["rho"] is None and two["p"] is None and two["n"] == 2 and "at least 3" in two["reason"]
    three = spearman([1.0, 2.0, 3.0], [0.9, 0.5, 0.1])  # perfect order: scipy's asymptotic p says 0
    assert three["rho"] == pytest.approx(-1.0) and three["p"] == pytest.approx(1 / 3) and three["p_min"] == pytest.approx(1 / 3)
    human, metric = [1.2, 2.9, 1.7, 2.2, 3.1], [0.8, 0.3, 0.5, 0.6, 0.2]
    got = spearman(human, metric)
    rho = spearmanr(human, metric).statistic
    brute = np.mean([abs(spearmanr(human, list(p)).statistic) >= abs(rho) - 1e-12 for p in permutations(metric)])
    assert got["rho"] == pytest.approx(rho) and got["p"] == pytest.approx(brute) and got["n"] == 5
    assert "exact permutation (120 orderings)" == got["p_method"]


def test_item_concordance_by_hand():
    from unicon.study.export import item_concordance

    rows_ = []
    for sample in range(4):  # two annotators per sample; on sample 3 both prefer the metric's worse model
        for annotator in ("x", "y"):
            better_first = sample < 3
            rows_ += [{"section": "generation", "sample": sample, "annotator": annotator, "model": "m1",
                       "rank": 1 if better_first else 2},
                      {"section": "generation", "sample": sample, "annotator": annotator, "model": "m2",
                       "rank": 2 if better_first else 1}]
    got = item_concordance(rows_, "generation", {"m1": 0.9, "m2": 0.4})
    assert (got["concordant"], got["discordant"], got["n_annotations"], got["n_samples"]) == (6, 2, 8, 4)
    assert got["agreement"] == pytest.approx(0.5) and got["share"] == pytest.approx(0.75)
    lo, hi = got["ci95"]
    assert lo <= 0.5 <= hi and lo >= -1 and hi <= 1 and lo < hi
    assert item_concordance(rows_, "generation", {"m1": 0.9, "m2": 0.4}) == got  # seeded
    tied = item_concordance(rows_, "generation", {"m1": 0.5, "m2": 0.5})
    assert tied["agreement"] is None and "different values" in tied["reason"]


def test_two_model_study_exports_no_rho(tmp_path):
    study, tokens = create(tmp_path, ("strong", "weak"), annotators="2", overlap=2, n=4)
    with ThreadServer(study) as srv:
        for i, t in enumerate(tokens.values()):
            ScriptedAnnotator(srv.url, t, seed=i).run()
    assert export_cli([str(study)]) == 0
    result = json.loads((study / "study.json").read_text())
    for section in db.SECTIONS:
        for key, corr in result["sections"][section]["spearman"].items():
            assert corr["rho"] is None and corr["n"] == 2 and "at least 3" in corr["reason"], (section, key)
        item = result["sections"][section]["per_item"]["MCD_avg"]
        assert item["n_annotations"] == 8 and item["n_samples"] == 4 and item["ci95"] is not None
    # strong beats weak on every seed but seed 0's caption (ground truth): 3 of 4 samples agree
    assert result["sections"]["understanding"]["per_item"]["MCD_avg"]["agreement"] == pytest.approx(0.5)
    assert result["workload"]["per_annotator"] == {f"annotator-{i}": {"pages": 4, "items": 8} for i in (1, 2)}
    assert "rho=" not in (study / "report.html").read_text()


def test_fidelity_heatmap_cells_and_its_place_in_report_html(tmp_path):
    """The paper's Fig. 14: rows are the image's (generation) rating, columns the caption's
    (understanding), Good-Medium-Poor from the top and from the left, each cell a percentage of the
    model's rated pairs; drawn in report.html once study.json has rated pairs, a note until then."""
    from unicon.study.export import compute, fidelity_matrix, report_html

    entry = {"n": 10, "consistent": 0.5, "pairs": {"good/good": 5, "good/poor": 3, "poor/good": 2}}
    m = fidelity_matrix(entry)
    good, poor = db.LEVELS.index("good"), db.LEVELS.index("poor")
    assert m[good, good] == 50.0 and m[poor, good] == 30.0 and m[good, poor] == 20.0  # [generation, understanding]
    assert m.sum() == pytest.approx(100.0) and np.trace(m) == 100.0 * entry["consistent"]
    assert not fidelity_matrix({"n": 0, "pairs": {}}).any()
    study, _ = create(tmp_path, ("strong", "weak"), annotators="2", n=2)
    result = compute(db.engine_for(db.study_url(study)))
    page = report_html(result)
    assert "fidelity heatmap" not in page and "No sample has both its caption and its image rated" in page
    result["consistency"]["strong"] = entry
    page = report_html(result)
    assert "alt='fidelity heatmap'" in page and page.count("data:image/png;base64,") == 3
