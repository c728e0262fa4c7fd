"""``unicon study create | serve | export``: the argument parsing of the study commands.

Each function takes the arguments after the subcommand, returns the exit status and raises
:class:`unicon.errors.UserError` (one line naming the file or setting) for user mistakes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from unicon.errors import UserError


def _engine(study: str | None, db_url: str | None):
    from unicon.study import db

    if db_url is None and study is None:
        raise UserError("give the study folder or --db URL")
    url = db_url or db.study_url(study)
    if url.startswith("sqlite:///") and not db_url and not Path(url[len("sqlite:///"):]).is_file():
        raise UserError(f"{url[len('sqlite:///'):]} not found: run unicon study create --out {study} first")
    return db.engine_for(url), url


def create_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="unicon study create",
                                description="Create a human cross-consistency study from drift outputs.")
    p.add_argument("runs", nargs="+", metavar="[NAME=]DRIFT_OUT",
                   help="drift output folders of the checkpoints (unicon evaluate drift ... --out), same seeds")
    p.add_argument("--out", required=True, help="study folder (database, tokens file)")
    p.add_argument("--db", default=None, help="SQLAlchemy URL (default: sqlite:///OUT/study.sqlite)")
    p.add_argument("--annotators", default="6", help="a count or a comma list of names (default 6)")
    p.add_argument("--overlap", type=int, default=2, help="distinct annotators per sample (default 2)")
    p.add_argument("--samples", type=int, default=None, help="use N seeds drawn at random (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the assignment and the output orders")
    p.add_argument("--common-seeds", action="store_true",
                   help="runs on other seed sets: use the seeds every run holds (default: refuse them)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="printed in front of the private links")
    a = p.parse_args(argv)

    import random

    from unicon.evaluation.cli_common import prepare_out
    from unicon.study import db
    from unicon.study.assign import annotator_names, create_study, write_tokens_file
    from unicon.study.inputs import read_runs

    names = annotator_names(a.annotators)
    runs, ids = read_runs(a.runs, common_seeds=a.common_seeds)
    if a.samples is not None:
        if a.samples < 1:
            raise UserError(f"--samples must be >= 1, got {a.samples}")
        ids = sorted(random.Random(a.seed).sample(ids, min(a.samples, len(ids))), key=ids.index)
    out = Path(a.out)
    tokens_file = out / db.TOKENS_FILE
    if tokens_file.exists():
        raise UserError(f"{tokens_file} exists: this folder already holds a study; use another --out")
    prepare_out(out)
    url = a.db or db.study_url(out)
    engine = db.engine_for(url)
    tokens = create_study(engine, runs, ids, names, overlap=a.overlap, seed=a.seed)
    db.checkpoint(engine)  # the database file alone holds the study
    links = {n: f"{a.base_url.rstrip('/')}/s/{t}" for n, t in tokens.items()}
    write_tokens_file(tokens_file, links)
    print(f"study: {len(ids)} samples x {len(runs)} models ({', '.join(r.name for r in runs)}), "
          f"{len(names)} annotators, overlap {a.overlap} -> {url}")
    print(f"private links (shown once; also in {tokens_file}, mode 0600):")
    for n, link in links.items():
        print(f"  {n}\t{link}")
    return 0


def serve_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="unicon study serve", description="Serve the annotation pages of a study.")
    p.add_argument("study", nargs="?", help="study folder (holds study.sqlite)")
    p.add_argument("--db", default=None, help="SQLAlchemy URL instead of the folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="stop serving after SECONDS (an annotation window; default: until Ctrl-C)")
    a = p.parse_args(argv)
    if a.stop_after is not None and a.stop_after <= 0:
        raise UserError(f"--stop-after must be a positive number of seconds, got {a.stop_after}")
    from unicon.study import db
    from unicon.study.app import check_port, serve

    engine, url = _engine(a.study, a.db)
    if not db.has_study(engine):
        raise UserError(f"{url}: no study in this database (unicon study create first)")
    check_port(a.host, a.port)
    print(f"serving {url} on http://{a.host}:{a.port}/s/<token> (Ctrl-C stops; judgements are kept)", flush=True)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: --host {a.host} lets other machines reach the pages; plain HTTP, so put a TLS proxy in "
              "front of it outside a trusted network (the tokens travel in the URL)", flush=True)
    serve(url, a.host, a.port, a.stop_after)
    return 0


def export_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="unicon study export",
                                description="Shares, mean ranks, agreement and metric correlations of a study.")
    p.add_argument("study", nargs="?", help="study folder (holds study.sqlite)")
    p.add_argument("--db", default=None, help="SQLAlchemy URL instead of the folder")
    p.add_argument("--out", default=None, help="output folder (default: the study folder)")
    a = p.parse_args(argv)
    from unicon.evaluation.cli_common import prepare_out
    from unicon.study import db
    from unicon.study.export import export

    engine, url = _engine(a.study, a.db)
    if not db.has_study(engine):
        raise UserError(f"{url}: no study in this database (unicon study create first)")
    out = prepare_out(a.out or a.study or ".")
    result = export(engine, out)
    print(f"{out / 'study.json'}, {out / 'report.html'}: {result['judgements']}/{result['assignments']} "
          "assignments judged")
    return 0
