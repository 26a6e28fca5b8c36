"""User-facing errors: one line saying what is wrong and what to do, no traceback."""


class UserError(Exception):
    """Bad input detected before any training starts. ``str(err)`` is the whole message."""
