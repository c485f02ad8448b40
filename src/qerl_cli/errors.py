"""The one exception type for mistakes a user can make: the CLI prints its message and exits 1."""


class QerlError(Exception):
    """A user-facing error: one clear sentence, no traceback."""
