"""Errors for bad input: the CLI prints them as one line and exits non-zero, before heavy work."""


class UsageError(ValueError):
    """Bad input from the user: an unknown name, a malformed file, a missing setup step."""
