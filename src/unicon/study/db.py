"""The study database: schema (SQLAlchemy Core), engine settings, tokens, and the reads and writes.

Any SQLAlchemy URL works; the default is a SQLite file ``<study>/study.sqlite``, opened in WAL mode
with a busy timeout, so every committed judgement survives a killed server and concurrent
submits wait for each other instead of failing. The file is created owner-only (mode 0600: it holds
the masking key and every judgement), and SQLite gives its ``-wal`` and ``-shm`` files the same mode;
:func:`checkpoint` moves the WAL's content into the file itself when the server stops.

Tables::

    meta         key -> JSON value (study settings: overlap, seed, created)
    models       id, name, source folder, metrics JSON (MCD_avg, MGG, GenEval from drift.json)
    samples      id, seed id, prompt (T0), input image (I0, PNG)
    outputs      id, sample, section (understanding | generation), model, caption or image (PNG)
    annotators   id, name, sha256 of the token (the token itself is never stored)
    assignments  id, annotator, sample, position in the annotator's queue, order JSON
                 {section: [output id, ...]}: the masked, per-instance randomised order
                 ("Output A" is order[0]); unique (annotator, sample)
    judgements   id, assignment (unique), payload JSON as the annotator saw it
                 {section: {"ratings": {letter: level}, "ranking": [letter, ...]}}, created

The masking key lives only here: pages and the API show letters, never model names or output ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

SECTIONS = ("understanding", "generation")
LEVELS = ("good", "medium", "poor")
#: ordinal value of a rating level (higher is better), Krippendorff's alpha input
LEVEL_VALUE = {"poor": 0, "medium": 1, "good": 2}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DB_FILE = "study.sqlite"
TOKENS_FILE = "tokens.txt"

metadata = sa.MetaData()
meta_t = sa.Table("meta", metadata, sa.Column("key", sa.String(64), primary_key=True),
                  sa.Column("value", sa.Text, nullable=False))
models_t = sa.Table(
    "models", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True), sa.Column("source", sa.Text, nullable=False),
    sa.Column("metrics", sa.Text, nullable=False),
)
samples_t = sa.Table(
    "samples", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("seed_id", sa.String(200), nullable=False, unique=True), sa.Column("prompt", sa.Text, nullable=False),
    sa.Column("input_png", sa.LargeBinary, nullable=False),
)
outputs_t = sa.Table(
    "outputs", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("sample_id", sa.Integer, sa.ForeignKey("samples.id"), nullable=False),
    sa.Column("section", sa.String(16), nullable=False),
    sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), nullable=False),
    sa.Column("caption", sa.Text), sa.Column("image_png", sa.LargeBinary),
    sa.UniqueConstraint("sample_id", "section", "model_id"),
)
annotators_t = sa.Table(
    "annotators", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
)
assignments_t = sa.Table(
    "assignments", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("annotator_id", sa.Integer, sa.ForeignKey("annotators.id"), nullable=False),
    sa.Column("sample_id", sa.Integer, sa.ForeignKey("samples.id"), nullable=False),
    sa.Column("position", sa.Integer, nullable=False), sa.Column("order_json", sa.Text, nullable=False),
    sa.UniqueConstraint("annotator_id", "sample_id"), sa.UniqueConstraint("annotator_id", "position"),
)
judgements_t = sa.Table(
    "judgements", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("assignment_id", sa.Integer, sa.ForeignKey("assignments.id"), nullable=False, unique=True),
    sa.Column("payload", sa.Text, nullable=False), sa.Column("created", sa.Float, nullable=False),
)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A private link token: 256 random bits from :mod:`secrets`, URL-safe."""
    return secrets.token_urlsafe(32)


def study_url(study: str | Path) -> str:
    """The database URL of a study: a SQLAlchemy URL as it is, else ``sqlite:///<folder>/study.sqlite``."""
    s = str(study)
    if "://" in s:
        return s
    return f"sqlite:///{Path(s).resolve() / DB_FILE}"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")  # a committed judgement is on disk before the reply
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def _create_owner_only(url: str) -> None:
    """Create the file of a SQLite ``url`` empty with mode 0600 when it does not exist yet (SQLite
    would create it with the umask's mode, usually world-readable)."""
    database = sa.engine.make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:  # it exists; or its folder is missing or not writable: SQLite's error says so on connect
        pass


def engine_for(url: str) -> sa.Engine:
    """An engine for ``url``; SQLite gets WAL, full sync, foreign keys and a 30 s busy timeout, and a
    new database file is created owner-only (module docstring)."""
    if url.startswith("sqlite"):
        _create_owner_only(url)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, pool_pre_ping=True)


def checkpoint(engine: sa.Engine) -> None:
    """Copy a SQLite database's WAL into the database file, empty the WAL and close the engine's
    connections, so that the file alone holds every judgement (a server's shutdown). Other
    databases: the connections are closed."""
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()


def has_study(engine: sa.Engine) -> bool:
    """A study is there when its settings are (tables left empty by a failed create do not count)."""
    if not sa.inspect(engine).has_table("meta"):
        return False
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(meta_t)).scalar_one() > 0


# ---------------------------------------------------------------------------------------------------------
# Reads used by the app and the export
# ---------------------------------------------------------------------------------------------------------
def annotator_for_token(conn: sa.Connection, token: str) -> dict | None:
    row = conn.execute(sa.select(annotators_t).where(annotators_t.c.token_hash == hash_token(token))).first()
    return dict(row._mapping) if row else None


def read_meta(conn: sa.Connection) -> dict[str, Any]:
    return {r.key: json.loads(r.value) for r in conn.execute(sa.select(meta_t))}


def progress(conn: sa.Connection, annotator_id: int) -> dict[str, int]:
    assigned = conn.execute(sa.select(sa.func.count()).select_from(assignments_t)
                            .where(assignments_t.c.annotator_id == annotator_id)).scalar_one()
    done = conn.execute(
        sa.select(sa.func.count()).select_from(judgements_t.join(assignments_t))
        .where(assignments_t.c.annotator_id == annotator_id)).scalar_one()
    return {"done": done, "assigned": assigned}


def queue(conn: sa.Connection, annotator_id: int) -> list[dict]:
    """The annotator's assignments in queue order, each with ``done`` (a judgement exists)."""
    q = (sa.select(assignments_t.c.id, assignments_t.c.sample_id, assignments_t.c.position,
                   judgements_t.c.id.label("judgement_id"))
         .select_from(assignments_t.outerjoin(judgements_t))
         .where(assignments_t.c.annotator_id == annotator_id).order_by(assignments_t.c.position))
    return [{"assignment_id": r.id, "sample_id": r.sample_id, "position": r.position,
             "done": r.judgement_id is not None} for r in conn.execute(q)]


def assignment(conn: sa.Connection, annotator_id: int, sample_id: int) -> dict | None:
    """The annotator's assignment of a sample (None when the sample is not theirs), with its judgement."""
    row = conn.execute(sa.select(assignments_t).where(
        assignments_t.c.annotator_id == annotator_id, assignments_t.c.sample_id == sample_id)).first()
    if row is None:
        return None
    out = dict(row._mapping)
    out["order"] = json.loads(out.pop("order_json"))
    j = conn.execute(sa.select(judgements_t.c.payload).where(judgements_t.c.assignment_id == row.id)).first()
    out["judgement"] = json.loads(j.payload) if j else None
    return out


def sample_view(conn: sa.Connection, a: dict) -> dict:
    """What an annotator sees of an assignment: prompt and masked outputs ("A", "B", ...) per section."""
    s = conn.execute(sa.select(samples_t.c.id, samples_t.c.prompt).where(samples_t.c.id == a["sample_id"])).one()
    view: dict[str, Any] = {"sample": s.id, "position": a["position"], "prompt": s.prompt, "judgement": a["judgement"]}
    for section in SECTIONS:
        ids = a["order"][section]
        rows = {r.id: r for r in conn.execute(sa.select(outputs_t.c.id, outputs_t.c.caption)
                                              .where(outputs_t.c.id.in_(ids)))}
        view[section] = [{"letter": LETTERS[i], "caption": rows[oid].caption if section == "understanding" else None}
                         for i, oid in enumerate(ids)]
    return view


def output_image(conn: sa.Connection, a: dict, section: str, letter: str) -> bytes | None:
    ids = a["order"].get(section, [])
    k = LETTERS.find(letter) if len(letter) == 1 else -1
    if k < 0 or k >= len(ids):
        return None
    return conn.execute(sa.select(outputs_t.c.image_png).where(outputs_t.c.id == ids[k])).scalar_one()


def input_image(conn: sa.Connection, sample_id: int) -> bytes:
    return conn.execute(sa.select(samples_t.c.input_png).where(samples_t.c.id == sample_id)).scalar_one()


# ---------------------------------------------------------------------------------------------------------
# The one write of the app
# ---------------------------------------------------------------------------------------------------------
def record_judgement(engine: sa.Engine, assignment_id: int, payload: dict) -> tuple[str, dict]:
    """Store a validated judgement in one transaction.

    Returns ``("created", payload)``; ``("duplicate", stored)`` when the same judgement is already
    stored (a retry or a second tab: nothing written); ``("conflict", stored)`` when a different one
    is (nothing written, the first kept). The unique constraint on ``assignment`` decides races.
    """
    text = json.dumps(payload, sort_keys=True)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(judgements_t).values(assignment_id=assignment_id, payload=text, created=time.time()))
        return "created", payload
    except IntegrityError:
        with engine.connect() as conn:
            stored = conn.execute(sa.select(judgements_t.c.payload)
                                  .where(judgements_t.c.assignment_id == assignment_id)).scalar_one()
        stored = json.loads(stored)
        return ("duplicate" if stored == json.loads(text) else "conflict"), stored


def all_judgements(conn: sa.Connection) -> list[dict]:
    """Every judgement resolved to models: one row per (judgement, section, output) with the
    annotator, sample, model name, rating level and rank (1 = best)."""
    models = {r.id: r.name for r in conn.execute(sa.select(models_t.c.id, models_t.c.name))}
    out_model = {r.id: models[r.model_id] for r in conn.execute(sa.select(outputs_t.c.id, outputs_t.c.model_id))}
    names = {r.id: r.name for r in conn.execute(sa.select(annotators_t.c.id, annotators_t.c.name))}
    q = sa.select(assignments_t.c.annotator_id, assignments_t.c.sample_id, assignments_t.c.order_json,
                  judgements_t.c.payload).select_from(judgements_t.join(assignments_t))
    rows = []
    for r in conn.execute(q):
        order, payload = json.loads(r.order_json), json.loads(r.payload)
        for section in SECTIONS:
            ranking = payload[section]["ranking"]
            for i, oid in enumerate(order[section]):
                letter = LETTERS[i]
                rows.append({"annotator": names[r.annotator_id], "sample": r.sample_id, "section": section,
                             "model": out_model[oid], "rating": payload[section]["ratings"][letter],
                             "rank": ranking.index(letter) + 1})
    return rows
