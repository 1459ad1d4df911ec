import copy
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def reported_record():
    """A valid reported record (a copy of one of the incident's)."""
    return json.loads((ROOT / "results/reported/incident/v032-mtp-k8.json").read_text())


@pytest.fixture
def measured_record():
    from spectie.fingerprint import now
    from spectie.records import measured_record

    return measured_record(
        record_id="test-measured", kind="chapter-run", chapter="incident", title="a test record",
        environment="cpu", parameters={"n": 1}, results={"value": 1.5}, started_at=now(),
        content_hash="0" * 64, dtype="bfloat16",
    )


@pytest.fixture
def deep_copy():
    return copy.deepcopy


def copy_project(destination: Path) -> Path:
    """Copy the project's own files (tracked or not ignored) into `destination`, as a clone would have."""
    import shutil
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@pytest.fixture
def project_copy(tmp_path, monkeypatch):
    """A copy of the project that the code under test treats as the project root."""
    root = copy_project(tmp_path / "project")
    monkeypatch.setenv("SPECTIE_ROOT", str(root))
    return root
