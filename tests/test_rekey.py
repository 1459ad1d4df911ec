"""Stored measurement keys recomputed from their records (spectie.rekey): today's key of a record made by today's
code is the key it holds (tests/test_book.py and tests/test_reproduce.py check it on the records their `make run`
measures), and the re-key protocol leaves every result as it was."""

import json
import shutil

import pytest

from conftest import ROOT
from spectie import rekey


def _a_committed_record(kind_folder: str, prefix: str):
    """A committed record of a CPU host whose records name its hardware, and that host."""
    from spectie.records.fingerprint import recorded_hardware

    for host in recorded_hardware(ROOT / "results"):
        found = sorted((ROOT / "results" / "measured" / f"cpu-{host}" / kind_folder).glob(f"{prefix}-*.json"))
        if found:
            return found[0], host
    raise AssertionError(f"no committed {prefix} record of a CPU host with its hardware")


def test_check_then_write_stores_todays_key_and_leaves_the_results(tmp_path):
    """`check --save` lists the records whose key held; after the key changed under them (as when code moves),
    `check` says so and exits 1, and `write --from` stores today's key again, every other byte as it was."""
    source, host = _a_committed_record("guidance", "tiestop-injection")
    copy = tmp_path / source.relative_to(ROOT)
    copy.parent.mkdir(parents=True)
    shutil.copy(source, copy)
    listed = tmp_path / "held.json"
    lines = []
    assert rekey.check(tmp_path, listed, log=lines.append) == 0
    assert json.loads(listed.read_text()) == [str(copy.relative_to(tmp_path))], lines
    original = json.loads(copy.read_text())
    moved = json.loads(copy.read_text())
    moved["parameters"]["measurement_key"] = "0" * 64  # the key an earlier layout of the code gave
    copy.write_text(json.dumps(moved))
    lines.clear()
    assert rekey.check(tmp_path, log=lines.append) == 1
    assert f"differs: {copy.relative_to(tmp_path)}" in lines
    assert rekey.write(tmp_path, listed, log=lines.append) == 0
    assert json.loads(copy.read_text()) == original and "stored today's key in 1 of 1 record(s)" in lines


def test_what_is_not_recomputed_is_said_and_a_bad_list_is_refused(tmp_path, capsys):
    from spectie.records.errors import UsageError

    source, _ = _a_committed_record("execution", "pipeline-timings")
    assert rekey.recomputed(source, {})[0] == "no key"
    engine, _ = _a_committed_record("reproduce", "reproduce")
    assert rekey.recomputed(engine, {})[0] == "host's hardware unknown"
    (tmp_path / "list.json").write_text("not json")
    with pytest.raises(UsageError, match="--from"):
        rekey.write(tmp_path, tmp_path / "list.json")
    assert rekey.main(["write", "--from", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: --from")
