"""The feedback times of scripts/time_pipeline.sh as a record, and the execution appendix's reading of it."""

import datetime as dt
import json
import time

import pytest

from conftest import run_main
from spectie.book import timings
from spectie.records.errors import UsageError

START = int(time.time()) - 3600  # the pipeline's clean build began an hour ago (epoch seconds)


def pipeline_folder(tmp_path, build_seconds=500, build_ok=True):
    """What time_pipeline.sh leaves in its clone: steps.jsonl, the clean build's chapters and measured records
    (one made during the clean build, one made before it)."""
    folder = tmp_path / "clone" / "_timings"
    folder.mkdir(parents=True)
    steps = [{"step": "fresh", "started": START - 900, "seconds": 640, "ok": True},
             {"step": "clean-build", "started": START, "seconds": build_seconds, "ok": build_ok},
             {"step": "built-test", "started": START + 600, "seconds": 230, "ok": True}]
    (folder / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (folder / "clean-build-chapters.json").write_text(json.dumps(
        [{"chapter": "guidance", "seconds": 300.4}, {"chapter": "reproduce", "seconds": 120.0},
         {"chapter": "summary", "seconds": 0.4}]))
    iso = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()  # noqa: E731
    for name, started, seconds in (("guard-survey-cpu-x", START + 200, 104), ("old-cpu-x", START - 5000, 9)):
        path = folder / "clean-build-measured" / "cpu-x" / "guidance" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"id": name, "kind": "guard-survey", "chapter": "guidance",
                                    "started_at": iso(started), "finished_at": iso(started + seconds)}))
    return folder.parent


def test_a_pipeline_run_becomes_a_record_and_the_appendix_says_what_its_first_build_spent(tmp_path):
    made = timings.make_record(pipeline_folder(tmp_path), new_host=True, results_dir=tmp_path / "results")
    assert made.kind == "pipeline-timings" and made.parameters.new_host
    # Only what the clean build measured counts among its measurements.
    assert made.results.clean_build_measurements == [
        {"record": "guard-survey-cpu-x", "kind": "guard-survey", "chapter": "guidance", "seconds": 104.0}]
    rows = timings.steps_table([made])
    assert [(r["what"], r["target (s)"], r["target met"]) for r in rows] == [
        ("fresh clone: make setup && make test", 600, "no"),
        ("make build from clean", 600, "yes"),  # a host new to the records: the build measures it
        ("make test, book built and current", 240, "yes")]
    text = timings.first_build_sentence([made])
    assert "took 500 s, within its target of 600 s" in text
    assert "guidance 300 s, reproduce 120 s" in text and "the HTML) 79 s" in text  # 500 - (300.4 + 120 + 0.4)
    assert "guard-survey (guard-survey-cpu-x) 104 s" in text
    assert timings.first_build_figure([made]) is not None


def test_a_first_build_over_its_target_or_failed_says_so(tmp_path):
    slow = timings.make_record(pipeline_folder(tmp_path / "a", 700), new_host=True, results_dir=tmp_path / "r1")
    assert "took 700 s, over its target of 600 s" in timings.first_build_sentence([slow])
    failed = timings.make_record(pipeline_folder(tmp_path / "b", 300, False), new_host=True,
                                 results_dir=tmp_path / "r2")
    assert "over its target of 600 s (it failed)" in timings.first_build_sentence([failed])
    assert timings.steps_table([failed])[1]["target met"] == "failed"


def test_without_a_new_host_run_the_appendix_names_the_command(tmp_path):
    known = timings.make_record(pipeline_folder(tmp_path), new_host=False, results_dir=tmp_path / "results")
    assert timings.steps_table([known])[1]["target (s)"] == 480
    assert timings.first_build_sentence([known]) == timings.first_build_sentence([])
    assert "not timed yet: NEW_HOST=1 scripts/time_pipeline.sh" in timings.first_build_sentence([])
    assert timings.first_build_figure([known]) is None


def test_a_folder_the_pipeline_did_not_run_in_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="steps.jsonl does not exist"):
        timings.read_run(tmp_path)
    result = run_main(timings.main, "record", str(tmp_path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_new_machine_on_known_hardware_is_its_own_run_with_the_known_hosts_target(tmp_path):
    """NEW_HOST=twin: a machine id of its own on hardware the records know. Its record stands beside the
    measure-everything run (another id), its clean build has the known host's target, and the appendix says which
    run is which, and which of the two is not timed yet."""
    twin = timings.make_record(pipeline_folder(tmp_path / "a"), new_host=True, hardware_known=True,
                               results_dir=tmp_path / "results")
    assert twin.id.endswith("-twin-host") and twin.parameters.command == timings.TWIN_COMMAND
    assert timings.steps_table([twin])[1]["target (s)"] == 480
    assert "its hardware known" in timings.steps_table([twin])[1]["machine"]
    text = timings.first_build_sentence([twin])
    assert "reused the measurements of a host of identical hardware" in text
    assert "took 500 s, over its target of 480 s" in text
    assert f"hardware new to the records is not timed yet: {timings.COMMAND}" in text
    assert "hardware the records know is not timed yet" not in text
    fresh = timings.make_record(pipeline_folder(tmp_path / "b"), new_host=True, results_dir=tmp_path / "results")
    assert fresh.id != twin.id and "not timed yet" not in timings.first_build_sentence([twin, fresh])
    with pytest.raises(UsageError, match="--new-host"):
        timings.make_record(pipeline_folder(tmp_path / "c"), new_host=False, hardware_known=True)
