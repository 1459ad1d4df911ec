"""Chapters executed by papermill into the book, re-run only when stale.

A chapter is stale when its content hash (`spectie.records.chapters.content_hash`: its notebook, parameters, the
package modules it imports, the libraries' versions and the input files it reads) differs from the hash stored in its
executed copy. The copy also keeps the digest of each input, so `spectie stale` says which input changed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from spectie.records.chapters import (CHAPTERS, EXECUTED_DIR, HASH_VARIABLE, Chapter, _stamp, content_hash,  # noqa: F401
                                      get_chapter, input_digests, load_parameters, notebook_parameters)
from spectie.records.paths import project_root

FAILED_DIR = "_build/failed"


def executed_path(chapter: Chapter) -> Path:
    return project_root() / EXECUTED_DIR / Path(chapter.notebook).name


def _stored_stamp(path: Path) -> dict | None:
    """The stamp an executed copy was made with (its content hash, its inputs' digests), or None if there is none."""
    if not path.is_file():
        return None
    try:
        stamp = json.loads(path.read_text())["metadata"]["spectie"]
        return stamp if isinstance(stamp["content_hash"], str) else None
    except (KeyError, ValueError, TypeError):
        return None


def stored_hash(path: Path) -> str | None:
    """The content hash an executed copy was made from, or None if there is none."""
    stamp = _stored_stamp(path)
    return stamp["content_hash"] if stamp else None


def stale_reasons(chapter: Chapter, parameters: dict | None = None) -> list[str]:
    """Why the chapter's executed copy is out of date (empty: it is current): which inputs are new, changed
    or gone since it was made. The executed copy is read once (it holds the chapter's figures)."""
    current = input_digests(chapter, parameters or {})
    stamp = _stored_stamp(executed_path(chapter))
    if stamp is None:
        return ["no executed copy yet"]
    if stamp["content_hash"] == _stamp(current):
        return []
    stored = stamp.get("inputs")
    if not isinstance(stored, dict):
        return ["its executed copy does not list its inputs (made by an older spectie)"]
    reasons = [f"changed: {name}" for name in sorted(current.keys() & stored.keys()) if current[name] != stored[name]]
    reasons += [f"new: {name}" for name in sorted(current.keys() - stored.keys())]
    reasons += [f"gone: {name}" for name in sorted(stored.keys() - current.keys())]
    return reasons or ["its inputs are the same but its stamp differs"]


def is_stale(chapter: Chapter, parameters: dict | None = None) -> bool:
    return stored_hash(executed_path(chapter)) != content_hash(chapter, parameters or {})


def execute(chapter: Chapter, parameters: dict | None = None, output: Path | None = None,
            progress: bool = True) -> Path:
    """Run the chapter's notebook with papermill and write the executed copy (with its hash).

    The copy is written to a temporary file first: a failed run leaves any earlier executed copy in
    place and keeps the partial notebook under _build/failed/ for inspection.
    """
    import nbformat
    import papermill

    root = project_root()
    parameters = parameters or {}
    output = output or executed_path(chapter)
    output.parent.mkdir(parents=True, exist_ok=True)
    digests = input_digests(chapter, parameters)
    stamp = _stamp(digests)
    # Not beside the executed copies: a run killed outright would leave it where the book would build it.
    scratch = root / "_build" / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=scratch, prefix=f"{output.stem}.", suffix=".ipynb")
    os.close(fd)
    os.environ[HASH_VARIABLE] = stamp  # the kernel inherits it: measured records carry the hash
    try:
        papermill.execute_notebook(
            str(root / chapter.notebook), tmp_name, parameters=parameters, cwd=str(root),
            progress_bar=progress, kernel_name="python3",
            # The kernel's stderr as it comes: the measurements' own progress bars (each engine, configuration or
            # prompt set: what runs, how many done, time left), not only papermill's count of cells.
            stderr_file=sys.stderr if progress else None,
        )
    except BaseException:
        failed = root / FAILED_DIR / output.name
        failed.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(tmp_name, failed)
        raise
    finally:
        os.environ.pop(HASH_VARIABLE, None)
    from spectie.records.fingerprint import device_name, host_id, now, source_revision

    notebook = nbformat.read(tmp_name, as_version=4)
    notebook.metadata["spectie"] = {"content_hash": stamp, "inputs": digests, "chapter": chapter.name,
                                    "parameters": parameters,
                                    "host_id": host_id(), "device": device_name(), "finished_at": now(),
                                    "source_commit": source_revision()["commit"]}
    nbformat.write(notebook, tmp_name)
    shutil.move(tmp_name, output)
    return output


def reasons_text(reasons: list[str], shown: int = 3) -> str:
    """The first few reasons, and how many more."""
    more = len(reasons) - shown
    return "; ".join(reasons[:shown]) + (f"; and {more} more" if more > 0 else "")


def build_stale(progress: bool = True, log=print) -> list[str]:
    """Execute every chapter whose executed copy is missing or out of date; return their names."""
    ran = []
    for chapter in CHAPTERS.values():
        reasons = stale_reasons(chapter)
        if not reasons:
            log(f"[up to date] {chapter.name}")
            continue
        log(f"[executing]  {chapter.name} ({chapter.notebook}): {reasons_text(reasons)}")
        execute(chapter, progress=progress)
        ran.append(chapter.name)
    return ran


def execution_rows() -> list[dict]:
    """When, where and how long each chapter's executed copy ran (papermill's times, this project's stamp); not
    the execution appendix itself, which runs after every other chapter and reads their copies."""
    rows = []
    for chapter in CHAPTERS.values():
        if chapter.name == "execution":
            continue
        path = executed_path(chapter)
        if not path.is_file():
            rows.append({"chapter": chapter.name, "executed": "not yet"})
            continue
        metadata = json.loads(path.read_text())["metadata"]
        stamp, timing = metadata.get("spectie", {}), metadata.get("papermill", {})
        rows.append({"chapter": chapter.name, "finished at (UTC)": (stamp.get("finished_at") or "unknown")[:19],
                     "seconds": round(timing["duration"], 1) if timing.get("duration") is not None else None,
                     "device": stamp.get("device", "unknown"), "host": stamp.get("host_id", "unknown"),
                     "commit": (stamp.get("source_commit") or "unknown")[:7],
                     "parameters": ", ".join(f"{k}={v}" for k, v in stamp.get("parameters", {}).items()) or "defaults"})
    return rows
