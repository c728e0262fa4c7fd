"""``python -m unicon.study create|serve|export ...``: the study commands without the unicon CLI (used by the
tests to run the server in a process of its own)."""

from __future__ import annotations

import sys

from unicon.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from unicon.study import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"create": cli.create_cli, "serve": cli.serve_cli, "export": cli.export_cli}
    if not argv or argv[0] not in commands:
        print("usage: python -m unicon.study {create,serve,export} ...", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C stops serve; its judgements are in the database
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
