"""User-facing errors: the CLI prints these as one line (no traceback) and exits non-zero."""


class UserError(Exception):
    """A mistake the user can fix: a bad path, key, value or file. The message names it."""
