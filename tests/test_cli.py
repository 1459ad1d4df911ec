"""Bad input gets a clear error and a non-zero exit, before any heavy work."""

import json
import os
import subprocess
import sys

from conftest import ROOT



def spectie(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "spectie", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_unknown_chapter_and_environment():
    result = spectie("run", "nope")
    assert result.returncode == 2
    assert "unknown chapter 'nope'; valid chapters: incident, margins, reproduce, reduction_order, guidance, diagnose, environments" in result.stderr
    result = spectie("run", "incident", "--env", "a100")
    assert result.returncode == 2
    assert "unknown environment 'a100'; valid environments:" in result.stderr and "v0.32.0-rtx4090" in result.stderr


def test_bad_parameters(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text("modle: Qwen/Qwen3.5-2B\n")
    result = spectie("run", "incident", "--params", str(params))
    assert result.returncode == 2 and "has no parameter(s) modle" in result.stderr
    params.write_text("a: [\n")
    result = spectie("run", "incident", "--params", str(params))
    assert result.returncode == 2 and "does not parse" in result.stderr


def test_check_names_the_bad_file_and_field(tmp_path, reported_record):
    reported = tmp_path / "reported"
    reported.mkdir()
    (reported / "ok.json").write_text(json.dumps(reported_record))
    assert spectie("check", "--results-dir", str(tmp_path)).returncode == 0
    (tmp_path / "stray.json").write_text(json.dumps(dict(reported_record, id="stray")))
    reported_record["id"] = "other"
    reported_record["environments"] = ["mars"]
    (reported / "unknown-env.json").write_text(json.dumps(reported_record))
    reported_record["id"] = "bad"
    reported_record["results"]["stopped_early"] = "yes"
    (reported / "bad.json").write_text(json.dumps(reported_record))
    result = spectie("check", "--results-dir", str(tmp_path))
    assert result.returncode == 1
    assert "bad.json: field 'results.stopped_early': 'yes' is not of type 'boolean'" in result.stderr
    assert "names unknown environment 'mars'" in result.stderr
    # A chapter's records are looked for only where they live (records.record_paths): one elsewhere is named.
    assert "stray.json: field '(file)': a reported record outside results/reported/" in result.stderr


def test_the_committed_records_check_clean():
    result = spectie("check")
    assert result.returncode == 0, result.stderr


def test_make_without_setup_says_so(tmp_path):
    env = dict(os.environ)
    for target in (["build"], ["run", "CHAPTER=incident"]):
        result = subprocess.run(["make", "-s", *target, f"VENV={tmp_path / 'no-venv'}"], cwd=ROOT,
                                capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode != 0
        assert "run 'make setup' first" in result.stderr


def test_build_refuses_a_broken_record_before_running_anything(project_copy):
    record = project_copy / "results" / "reported" / "incident" / "b200-k7.json"
    record.write_text(record.read_text().replace('"stopped_early": true', '"stopped_early": "maybe"'))
    result = spectie("build", cwd=project_copy)
    assert result.returncode == 2
    assert "b200-k7.json: field 'results.stopped_early'" in result.stderr
    assert not (project_copy / "book" / "generated").exists()


def test_make_build_without_the_organism_says_so():
    result = subprocess.run(["make", "-s", "build", "ORGANISM=artifacts/not-built"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "the tokenizer or the organism is missing from artifacts/: run 'make setup'" in result.stderr


def test_a_reader_that_stops_reading_is_not_an_internal_error(monkeypatch, capsys):
    """`spectie stale | head -3`: the pipe closes while spectie still writes; it ends quietly with 0, not with
    "internal error: BrokenPipeError" (exit 3)."""
    import os

    from spectie import cli

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone: every write fails with EPIPE
    closed_pipe = os.fdopen(write_end, "w", buffering=1)  # line-buffered, as a terminal or `| head` sees each line
    monkeypatch.setattr("sys.stdout", closed_pipe)
    assert cli.main(["list"]) == 0
    monkeypatch.undo()
    closed_pipe.close()
    assert "internal error" not in capsys.readouterr().err


def test_a_missing_dependency_is_an_incomplete_install_not_a_bug(monkeypatch, capsys):
    """The guard started with an interpreter that lacks jsonschema (vLLM's environment on a GPU host): one line
    naming the library and the interpreter, exit 2, not "internal error ... a bug in spectie" (exit 3)."""
    import sys

    from spectie import cli

    def lacks_jsonschema(args):
        raise ModuleNotFoundError("No module named 'jsonschema'", name="jsonschema")

    monkeypatch.setattr(cli, "_cmd_list", lacks_jsonschema)
    monkeypatch.setattr(cli, "_parser", lambda: cli.build_parser())
    assert cli.main(["list"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err
    assert "needs jsonschema" in err and sys.executable in err
