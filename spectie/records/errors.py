"""Errors for bad input: the CLI prints them as one line and exits non-zero, before heavy work."""


class UsageError(ValueError):
    """Bad input from the user: an unknown name, a malformed file, a missing setup step."""


def read_yaml(path, what: str):
    """The content of a YAML file the user gave; a missing or unparseable file is a UsageError
    naming it as `what` (e.g. "parameters file")."""
    from pathlib import Path

    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} {str(path)!r} does not parse: {exc}") from None
