"""Where the project's folders are, wherever the code is run from (a notebook, the CLI, a test)."""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """The folder holding `_config.yml`: $SPECTIE_ROOT if set, else found by walking up from cwd."""
    if os.environ.get("SPECTIE_ROOT"):
        return Path(os.environ["SPECTIE_ROOT"]).resolve()
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "_config.yml").is_file() and (folder / "spectie").is_dir():
            return folder
    # Fall back to the checkout this package lives in.
    return Path(__file__).resolve().parents[2]


def organism_dir() -> Path:
    """Where `make setup` unpacks the pinned organism (artifacts/organism)."""
    return project_root() / "artifacts" / "organism"
