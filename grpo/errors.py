"""User-facing errors: the CLI prints their message as one line and exits non-zero."""


class GrpoError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits 2."""
