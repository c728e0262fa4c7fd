"""The annotation web app (Starlette, server-rendered, no external resources; served by uvicorn).

Routes (``TOKEN`` is an annotator's private token; only its sha256 is in the database):

* ``GET  /s/TOKEN``                          redirect to the first unjudged sample (resume), or the done page
* ``GET  /s/TOKEN/sample/ID``                the page: understanding and generation sections, progress
* ``POST /s/TOKEN/sample/ID``                a judgement, JSON (the page's script) or a plain form (no script)
* ``GET  /s/TOKEN/sample/ID/input.png``      the input image; ``.../gen/LETTER.png`` a masked generated image
* ``GET  /api/next``, ``GET|POST /api/samples/ID``, ``GET /api/samples/ID/input.png``,
  ``GET /api/samples/ID/gen/LETTER.png``, ``GET /api/progress``: the same with
  ``Authorization: Bearer TOKEN`` (the scripted annotators, scripts)

Status codes: no token 401, unknown token 403, a sample not assigned to the token 404 (the same
answer as a sample that does not exist), an invalid judgement 400 / 413 (body over 64 KiB) / 415
(neither JSON nor a form; media types compare case-insensitively, parameters such as ``charset``
ignored), a replay of the stored judgement 200 (``"status": "duplicate"``), a different second
judgement 409 (the first is kept). Nothing is written unless the judgement is valid; each write is one transaction.
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import jinja2
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from unicon.errors import UserError
from unicon.study import db
from unicon.study.ranking import ranking_contradiction

MAX_BODY = 64 * 1024
HERE = Path(__file__).parent
SECURITY_HEADERS = {
    "Referrer-Policy": "no-referrer",  # the token is in the URL: never send it to another site
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
}


class HTTPProblem(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def validate(payload: Any, counts: dict[str, int]) -> dict:
    """A judgement as stored, or :class:`HTTPProblem` 400 naming what is wrong.

    ``payload = {section: {"ratings": {letter: good|medium|poor}, "ranking": [letter, ...best first]}}``
    for both sections; the letters are those shown (``counts[section]`` outputs: A, B, ...). A ranking
    that puts an output above a better-rated one is refused (:mod:`unicon.study.ranking`).
    """
    if not isinstance(payload, dict):
        raise HTTPProblem(400, "the judgement must be a JSON object with 'understanding' and 'generation'")
    extra = sorted(set(payload) - set(db.SECTIONS))
    if extra:
        raise HTTPProblem(400, f"unknown field(s) {extra}; expected 'understanding' and 'generation'")
    out = {}
    for section in db.SECTIONS:
        part = payload.get(section)
        letters = list(db.LETTERS[: counts[section]])
        if not isinstance(part, dict) or set(part) != {"ratings", "ranking"}:
            raise HTTPProblem(400, f"{section}: expected {{'ratings': {{letter: level}}, 'ranking': [letters]}}")
        ratings, ranking = part["ratings"], part["ranking"]
        if not isinstance(ratings, dict) or sorted(ratings) != letters:
            raise HTTPProblem(400, f"{section}.ratings: rate every output exactly once: {letters}")
        bad = {k: v for k, v in ratings.items() if v not in db.LEVELS}
        if bad:
            raise HTTPProblem(400, f"{section}.ratings: {bad} not one of {list(db.LEVELS)}")
        if not isinstance(ranking, list) or not all(isinstance(x, str) for x in ranking) \
                or sorted(ranking) != letters:
            raise HTTPProblem(400, f"{section}.ranking: must order every output once (a permutation of {letters}), "
                                   f"got {ranking!r}")
        out[section] = {"ratings": {k: ratings[k] for k in letters}, "ranking": list(ranking)}
        why = ranking_contradiction(out[section]["ratings"], out[section]["ranking"])
        if why:
            raise HTTPProblem(400, f"{section}.ranking: {why}")
    return out


def form_to_payload(fields: dict[str, list[str]], counts: dict[str, int]) -> dict:
    """The page's plain form (``<section>.rating.<L>``, ``<section>.rank.<L>`` = 1..n) as a JSON judgement."""
    payload: dict[str, Any] = {}
    for section in db.SECTIONS:
        letters = db.LETTERS[: counts[section]]
        ratings = {L: fields.get(f"{section}.rating.{L}", [None])[0] for L in letters}
        missing = [L for L, v in ratings.items() if v is None]
        if missing:
            raise HTTPProblem(400, f"{section}: rate output(s) {', '.join(missing)} (Good, Medium or Poor)")
        try:
            ranks = {L: int(fields.get(f"{section}.rank.{L}", ["x"])[0]) for L in letters}
        except ValueError:
            raise HTTPProblem(400, f"{section}: give every output a rank 1..{len(letters)}") from None
        if sorted(ranks.values()) != list(range(1, len(letters) + 1)):
            raise HTTPProblem(400, f"{section}: the ranks must be 1..{len(letters)}, each used once")
        payload[section] = {"ratings": ratings, "ranking": sorted(letters, key=lambda L: ranks[L])}
    return payload


def media_type(content_type: str) -> str:
    """The media type of a ``Content-Type`` header, lower case, without parameters:
    ``"Application/JSON; charset=UTF-8"`` -> ``"application/json"``."""
    return content_type.split(";", 1)[0].strip().lower()


async def read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        raise HTTPProblem(413, f"the body is larger than {MAX_BODY // 1024} KiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise HTTPProblem(413, f"the body is larger than {MAX_BODY // 1024} KiB")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(url: str) -> Starlette:
    """The app over the study database at ``url`` (the engine is created once, WAL for SQLite)."""
    engine = db.engine_for(url)
    if not db.has_study(engine):
        raise ValueError(f"{url}: no study in this database (unicon study create first)")
    templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)

    # -- helpers (run in the thread pool: blocking database calls) --------------------------------------
    def who(token: str | None) -> dict:
        if not token:
            raise HTTPProblem(401, "no token: open your private study link (or send Authorization: Bearer TOKEN)")
        with engine.connect() as conn:
            person = db.annotator_for_token(conn, token)
        if person is None:
            raise HTTPProblem(403, "unknown token: check your private study link")
        return person

    def load(token: str | None, sample_id: int) -> tuple[dict, dict]:
        person = who(token)
        with engine.connect() as conn:
            a = db.assignment(conn, person["id"], sample_id)
        if a is None:
            raise HTTPProblem(404, f"sample {sample_id} is not in your assignments")
        return person, a

    def next_sample(person: dict) -> int | None:
        with engine.connect() as conn:
            return next((q["sample_id"] for q in db.queue(conn, person["id"]) if not q["done"]), None)

    def page_context(token: str, person: dict, a: dict) -> dict:
        with engine.connect() as conn:
            view = db.sample_view(conn, a)
            prog = db.progress(conn, person["id"])
            q = db.queue(conn, person["id"])
        base = f"/s/{token}/sample/{a['sample_id']}"
        return {"view": view, "progress": prog, "base": base, "levels": db.LEVELS, "name": person["name"],
                "queue": q, "token": token, "judgement": a["judgement"]}

    def submit(token: str | None, sample_id: int, body: bytes, content_type: str) -> tuple[int, dict, dict]:
        person, a = load(token, sample_id)
        counts = {s: len(a["order"][s]) for s in db.SECTIONS}
        kind = media_type(content_type)
        if kind == "application/json":
            try:
                raw = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise HTTPProblem(400, f"the body is not valid JSON ({e})") from None
            except RecursionError:
                raise HTTPProblem(400, "the body is not a judgement (nested too deeply)") from None
        elif kind == "application/x-www-form-urlencoded":
            raw = form_to_payload(parse_qs(body.decode("utf-8", "replace")), counts)
        else:
            raise HTTPProblem(415, "send application/json or a form (application/x-www-form-urlencoded)")
        payload = validate(raw, counts)
        status, stored = db.record_judgement(engine, a["id"], payload)
        code = {"created": 201, "duplicate": 200, "conflict": 409}[status]
        info = {"status": status, "judgement": stored}
        if status == "conflict":
            info["error"] = "this sample already has a different judgement from you; the first one is kept"
        return code, info, person

    # -- responses -----------------------------------------------------------------------------------
    def problem(e: HTTPProblem, html: bool) -> Response:
        if html:
            body = templates.get_template("message.html").render(title=f"Error {e.status}", message=e.message)
            return HTMLResponse(body, status_code=e.status, headers=SECURITY_HEADERS)
        return JSONResponse({"error": e.message}, status_code=e.status, headers=SECURITY_HEADERS)

    def bearer(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def sample_id_of(request: Request) -> int:
        try:
            return int(request.path_params["sid"])
        except ValueError:
            raise HTTPProblem(404, "no such sample") from None

    def png(data: bytes | None) -> Response:
        if data is None:
            raise HTTPProblem(404, "no such image")
        return Response(data, media_type="image/png", headers=SECURITY_HEADERS)

    # -- browser routes ------------------------------------------------------------------------------
    async def home(request: Request) -> Response:
        body = templates.get_template("message.html").render(
            title="Cross-consistency study", message="Open the private link you were given.")
        return HTMLResponse(body, headers=SECURITY_HEADERS)

    async def resume(request: Request) -> Response:
        token = request.path_params["token"]
        try:
            person = await run_in_threadpool(who, token)
            nxt = await run_in_threadpool(next_sample, person)
        except HTTPProblem as e:
            return problem(e, html=True)
        if nxt is None:
            with engine.connect() as conn:
                prog = await run_in_threadpool(db.progress, conn, person["id"])
            body = templates.get_template("message.html").render(
                title="Thank you", message=f"All {prog['assigned']} samples are done ({prog['done']}/{prog['assigned']}).",
                done=True)
            return HTMLResponse(body, headers=SECURITY_HEADERS)
        return RedirectResponse(f"/s/{token}/sample/{nxt}", status_code=303, headers=SECURITY_HEADERS)

    async def page(request: Request) -> Response:
        token = request.path_params["token"]
        try:
            person, a = await run_in_threadpool(load, token, sample_id_of(request))
            ctx = await run_in_threadpool(page_context, token, person, a)
        except HTTPProblem as e:
            return problem(e, html=True)
        return HTMLResponse(templates.get_template("sample.html").render(**ctx), headers=SECURITY_HEADERS)

    async def page_submit(request: Request) -> Response:
        token = request.path_params["token"]
        ctype = request.headers.get("content-type", "")
        is_form = media_type(ctype) == "application/x-www-form-urlencoded"
        try:
            body = await read_body(request)
            code, info, person = await run_in_threadpool(submit, token, sample_id_of(request), body, ctype)
        except HTTPProblem as e:
            return problem(e, html=is_form)
        if is_form and code in (200, 201):
            return RedirectResponse(f"/s/{token}", status_code=303, headers=SECURITY_HEADERS)
        if is_form:
            return problem(HTTPProblem(code, info["error"]), html=True)
        info["next"] = f"/s/{token}"
        return JSONResponse(info, status_code=code, headers=SECURITY_HEADERS)

    async def image(token: str | None, request: Request) -> Response:
        """The sample's input image, or (with a ``letter`` path parameter) that generated output, as
        PNG, for ``token``'s own assignment only."""
        try:
            _, a = await run_in_threadpool(load, token, sample_id_of(request))
            letter = request.path_params.get("letter")
            with engine.connect() as conn:
                if letter is None:
                    return png(await run_in_threadpool(db.input_image, conn, a["sample_id"]))
                return png(await run_in_threadpool(db.output_image, conn, a, "generation", letter))
        except HTTPProblem as e:
            return problem(e, html=False)

    async def page_image(request: Request) -> Response:
        return await image(request.path_params["token"], request)

    # -- API (Bearer token) ----------------------------------------------------------------------------
    async def api_progress(request: Request) -> Response:
        try:
            person = await run_in_threadpool(who, bearer(request))
            with engine.connect() as conn:
                prog = await run_in_threadpool(db.progress, conn, person["id"])
        except HTTPProblem as e:
            return problem(e, html=False)
        return JSONResponse(prog, headers=SECURITY_HEADERS)

    async def api_next(request: Request) -> Response:
        try:
            person = await run_in_threadpool(who, bearer(request))
            nxt = await run_in_threadpool(next_sample, person)
        except HTTPProblem as e:
            return problem(e, html=False)
        return JSONResponse({"sample": nxt}, headers=SECURITY_HEADERS)

    def api_view(token: str | None, sample_id: int) -> dict:
        _, a = load(token, sample_id)
        with engine.connect() as conn:
            view = db.sample_view(conn, a)
        base = f"/api/samples/{sample_id}"
        view["input_image"] = f"{base}/input.png"
        for o in view["generation"]:
            o["image"] = f"{base}/gen/{o['letter']}.png"
        return view

    async def api_sample(request: Request) -> Response:
        try:
            sid = sample_id_of(request)
            if request.method == "POST":
                body = await read_body(request)
                code, info, _ = await run_in_threadpool(
                    submit, bearer(request), sid, body, request.headers.get("content-type", ""))
                return JSONResponse(info, status_code=code, headers=SECURITY_HEADERS)
            return JSONResponse(await run_in_threadpool(api_view, bearer(request), sid), headers=SECURITY_HEADERS)
        except HTTPProblem as e:
            return problem(e, html=False)

    async def api_image(request: Request) -> Response:
        return await image(bearer(request), request)

    routes = [
        Route("/", home),
        Route("/s/{token}", resume),
        Route("/s/{token}/sample/{sid}", page, methods=["GET"]),
        Route("/s/{token}/sample/{sid}", page_submit, methods=["POST"]),
        Route("/s/{token}/sample/{sid}/input.png", page_image),
        Route("/s/{token}/sample/{sid}/gen/{letter}.png", page_image),
        Route("/api/progress", api_progress),
        Route("/api/next", api_next),
        Route("/api/samples/{sid}", api_sample, methods=["GET", "POST"]),
        Route("/api/samples/{sid}/input.png", api_image),
        Route("/api/samples/{sid}/gen/{letter}.png", api_image),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.engine = engine
    return app


def check_port(host: str, port: int) -> None:
    """A :class:`UserError` naming ``host:port`` when the server could not listen there (in use, or an
    address of another machine), checked before anything is printed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host}: not an address of this machine ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"{host}:{port} is in use ({e.strerror}): stop what listens there or pick another "
                                "port with --port") from None
            raise UserError(f"{host}:{port} cannot be served here ({e.strerror}): check --host and --port") from None


def serve(url: str, host: str = "127.0.0.1", port: int = 8000, stop_after: float | None = None) -> None:
    """Run the app with uvicorn (one process; SQLite serialises the writes) until interrupted or,
    with ``stop_after``, for that many seconds (a time-boxed annotation window; every submitted
    judgement is already committed when it stops). On the way out, even after Ctrl-C, the WAL is
    checkpointed into the database file (:func:`db.checkpoint`)."""
    import threading

    import uvicorn

    app = create_app(url)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    if stop_after is not None:
        timer = threading.Timer(stop_after, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()
    try:
        server.run()
    finally:
        db.checkpoint(app.state.engine)


def engine_counts(engine: sa.Engine) -> dict[str, int]:
    """Row counts of every table (the tests compare them before and after refused requests)."""
    with engine.connect() as conn:
        return {t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                for t in db.metadata.sorted_tables}
