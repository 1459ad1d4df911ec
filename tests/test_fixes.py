"""The fix ledger as a record, and what it says of one vLLM release (spectie fixes)."""

import json

import pytest

from spectie.tools import fixes
from spectie.cli import main
from spectie.records.errors import UsageError
from spectie.records.record_types import Record
from spectie.records.store import read_record, validate_record


def ledger_like(per_release: dict[str, dict[str, str]], first: dict[str, str | None]) -> Record:
    """A record shaped like the ledger's, for fixes -> {release: verdict}."""
    releases = sorted({r for verdicts in per_release.values() for r in verdicts})
    return Record.from_dict({
        "schema_version": 1, "id": "fix-ledger-test", "provenance": "measured", "kind": "fix-ledger",
        "chapter": fixes.CHAPTER, "title": "a ledger", "environments": [fixes.ENVIRONMENT],
        "parameters": {"releases": releases},
        "results": {"fixes": [{"fix": name, "failure": fixes.failure_of(name), "title": name, "state": "open",
                               "threads": [f"https://github.com/vllm-project/vllm/pull/{len(name)}"],
                               "per_release": verdicts, "first_release": first[name]}
                              for name, verdicts in per_release.items()]}})


def test_the_record_is_made_from_the_committed_ledger_and_remade_when_it_changes(tmp_path):
    """The record the book shows holds the committed sources/fix_ledger.json's verdicts; it is written once
    per machine and made again when the ledger is re-run (another sha256)."""
    record = fixes.ensure_record(tmp_path)
    assert isinstance(record, Record)
    validate_record(record.stored)
    ledger = fixes.read_ledger()
    assert {f["fix"]: f["first_release"] for f in record.results.fixes} == {
        name: summary["first_release_with_fix"] for name, summary in ledger["summary"].items()}
    assert {f["fix"]: f["per_release"] for f in record.results.fixes} == {
        name: summary["per_release"] for name, summary in ledger["summary"].items()}
    assert [r["version"] for r in record.results.releases] == ledger["releases_requested"]
    [path] = tmp_path.rglob("*.json")
    assert read_record(path).stored == record.stored
    written = path.stat().st_mtime_ns
    assert fixes.ensure_record(tmp_path).stored == record.stored  # read back, not made again
    assert path.stat().st_mtime_ns == written
    stale = json.loads(path.read_text())
    stale["parameters"]["source_sha256"] = "0" * 64
    path.write_text(json.dumps(stale))
    assert fixes.ensure_record(tmp_path).parameters.source_sha256 == record.parameters.source_sha256
    assert json.loads(path.read_text())["parameters"]["source_sha256"] != "0" * 64


def test_a_release_is_told_which_fixes_it_has_lacks_or_cannot_tell():
    record = ledger_like({"51812": {"0.27.0": "absent", "0.28.0": "present"},
                          "39273 / PR 52942": {"0.27.0": "absent", "0.28.0": "unknown"},
                          "41467": {"0.27.0": "unknown", "0.28.0": "mixed"}},
                         {"51812": "0.28.0", "39273 / PR 52942": None, "41467": None})
    said = {r["fix"]: r["this release"] for r in fixes.fixes_for(record, "0.28.0+cpu")}
    assert said == {"51812": "has it", "39273 / PR 52942": fixes.VERDICTS["unknown"],
                    "41467": fixes.VERDICTS["mixed"]}
    assert fixes.fixes_for(record, "0.27.0")[0]["this release"] == "lacks it"
    newer = {r["fix"]: r["this release"] for r in fixes.fixes_for(record, "0.30.1")}
    assert newer["51812"] == "not checked (0.30.1 is newer than the ledger; 0.28.0 and later had it)"
    assert newer["41467"] == "not checked (the ledger read 0.27.0 to 0.28.0)"
    assert fixes.fixes_for(record, "0.26.0")[0]["this release"].startswith("not checked (the ledger read")
    assert fixes.releases_text(record, ["0.27.0", "0.28.0"]) == (
        "vLLM 0.27.0 has none of them; lacks 51812, 39273 / PR 52942; cannot tell for 1; "
        "vLLM 0.28.0 has 51812; lacks none; cannot tell for 2")
    for bad in ("abc", "0.32", ""):
        with pytest.raises(UsageError, match="not a vLLM release version"):
            fixes.fixes_for(record, bad)


def test_the_cli_reads_the_recorded_ledger_for_a_given_release(capsys):
    assert main(["fixes", "--vllm", "0.31.0", "--json"]) == 0
    rows = {r["fix"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["51812"]["this release"] == "has it" and rows["51812"]["first release with it"] == "0.28.0"
    assert rows["39273 / PR 40738"]["this release"] == "lacks it"
    assert rows["41467"]["this release"].startswith("cannot tell")
    assert main(["fixes", "--vllm", "nightly"]) == 2
    assert "not a vLLM release version" in capsys.readouterr().err


def test_the_table_says_none_only_where_every_release_could_tell():
    record = ledger_like({"a": {"0.27.0": "absent", "0.28.0": "absent"}, "b": {"0.27.0": "absent", "0.28.0": "unknown"},
                          "c": {"0.27.0": "unknown", "0.28.0": "unknown"}, "d": {"0.27.0": "absent", "0.28.0": "present"}},
                         {"a": None, "b": None, "c": None, "d": "0.28.0"})
    table = fixes.ledger_table(record, measured={"0.28.0"})
    assert table["that release run here on a GPU"].to_dict() == {"a": "—", "b": "—", "c": "—", "d": "yes"}
    assert table.loc["d", "state"] == "open" and 'href="https://github.com/vllm-project/vllm/pull/1"' in table.loc["d", "thread"]
    assert table["first release with it"].to_dict() == {
        "a": "none of these", "b": "none of those that can tell; 0.28.0 cannot tell",
        "c": "unknown: no release's source can tell", "d": "0.28.0"}
    assert "failure" not in table.columns
    assert table.loc["d", "0.27.0"] == "A" and table.loc["d", "0.28.0"] == "P" and table.loc["b", "0.28.0"] == "?"


def test_a_pull_request_read_in_two_marker_groups_is_named_once_per_release():
    record = ledger_like({"39273 / PR 7 (identifier)": {"0.27.0": "absent", "0.28.0": "absent"},
                          "39273 / PR 7 (behaviour)": {"0.27.0": "absent", "0.28.0": "present"},
                          "39273 / PR 8": {"0.27.0": "absent", "0.28.0": "absent"}},
                         {"39273 / PR 7 (identifier)": None, "39273 / PR 7 (behaviour)": "0.28.0", "39273 / PR 8": None})
    assert fixes.pull_requests_text(record, "0.27.0") == "#7 (open): lacks it; #8 (open): lacks it"
    assert fixes.pull_requests_text(record, "0.28.0") == ("#7 (open): identifier lacks it, behaviour has it; "
                                                          "#8 (open): lacks it")


def test_each_threads_failure_is_said_once():
    record = ledger_like({"39273 / PR 1": {"0.27.0": "absent"}, "39273 / PR 2": {"0.27.0": "absent"},
                          "51812": {"0.27.0": "present"}}, {"39273 / PR 1": None, "39273 / PR 2": None, "51812": "0.27.0"})
    assert fixes.failures_text(record) == f"#39273: {fixes.FAILURES['39273']}; #51812: {fixes.FAILURES['51812']}"
