"""The record schema, validation on write and read, and atomic writes."""

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, typed
from spectie.records.record_types import KINDS, EngineConfiguration, EngineOutcome, Fingerprint, Record
from spectie.records.store import (SCHEMA_PATH, RecordError, check_records, load_records, measured_path, read_record,
                             record_paths, validate_record, write_record)


def test_incident_records_and_a_measured_record_validate(reported_record, measured_record):
    validate_record(reported_record)
    validate_record(measured_record)
    fp = measured_record["fingerprint"]
    for key in ("host_id", "os", "cpu", "gpu", "gpu_driver", "cuda", "python", "torch", "transformers", "vllm", "dtype"):
        assert key in fp
    assert fp["dtype"] == "bfloat16"


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.update(provenance="guessed"), "provenance"),
    (lambda r: r["results"].update(runs_total=-1), "results.runs_total"),
    (lambda r: r.pop("source"), "(record)"),
    (lambda r: r.update(fingerprint={"host_id": "x"}), "fingerprint"),
    (lambda r: r["parameters"].update(method="beam"), "parameters.method"),
    (lambda r: r.update(surprise=1), "(record)"),
])
def test_a_bad_reported_record_names_the_field(reported_record, mutate, field):
    mutate(reported_record)
    with pytest.raises(RecordError) as info:
        validate_record(reported_record, where="some/file.json")
    assert info.value.where == "some/file.json"
    assert info.value.field == field
    assert "some/file.json" in str(info.value)


def test_a_measured_record_needs_its_fingerprint_and_times(measured_record, deep_copy):
    for key in ("fingerprint", "started_at", "content_hash", "package_version"):
        broken = deep_copy(measured_record)
        del broken[key]
        with pytest.raises(RecordError):
            validate_record(broken)
    broken = deep_copy(measured_record)
    broken["fingerprint"].pop("gpu_driver")
    with pytest.raises(RecordError) as info:
        validate_record(broken)
    assert info.value.field == "fingerprint"
    broken = deep_copy(measured_record)
    broken["finished_at"] = "2000-01-01T00:00:00+00:00"
    with pytest.raises(RecordError, match="earlier than started_at"):
        validate_record(broken)


def test_an_invalid_record_is_not_written(tmp_path, reported_record):
    path = tmp_path / "r.json"
    write_record(reported_record, path)
    before = path.read_text()
    reported_record["provenance"] = "guessed"
    with pytest.raises(RecordError):
        write_record(reported_record, path)
    assert path.read_text() == before


def test_a_write_that_fails_midway_leaves_the_old_record(tmp_path, reported_record):
    path = tmp_path / "r.json"
    write_record(reported_record, path)
    before = path.read_text()
    reported_record["results"]["tail_text"] = "x"

    def failing_replace(src, dst):
        raise OSError("disk went away")

    original = os.replace
    os.replace = failing_replace
    try:
        with pytest.raises(OSError):
            write_record(reported_record, path)
    finally:
        os.replace = original
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the temporary file is gone


KILLED_WRITER = r"""
import os, sys, time
from pathlib import Path
from spectie.records.store import write_record
import json
record = json.loads(Path(sys.argv[1]).read_text())
record["results"]["tail_text"] = "new " * 200000
def hang(src, dst):  # the temporary file is complete, the rename has not happened: get killed here
    Path(sys.argv[2]).write_text("ready")
    time.sleep(600)
os.replace = hang
write_record(record, sys.argv[1])
"""


def test_killing_a_writer_mid_write_leaves_the_old_record(tmp_path, reported_record):
    path = tmp_path / "reported" / "r.json"
    write_record(reported_record, path)
    before = path.read_text()
    ready = tmp_path / "ready"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(ready)])
    try:
        deadline = time.time() + 60
        while not ready.exists():
            assert writer.poll() is None, "the writer exited before the rename"
            assert time.time() < deadline, "the writer never reached the rename"
            time.sleep(0.05)
        temporaries = [p for p in path.parent.iterdir() if p.name.startswith(".r.json.")]
        assert temporaries and temporaries[0].stat().st_size > 800000  # the new content was written...
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert path.read_text() == before  # ...but the old record is what is there
    assert read_record(path).stored == reported_record
    assert [r.id for r in load_records(tmp_path)] == [reported_record["id"]]  # leftovers are not records


def test_reading_reports_a_broken_file_by_name_and_field(tmp_path, reported_record):
    write_record(reported_record, tmp_path / "reported" / "good.json")
    (tmp_path / "reported" / "not-json.json").write_text("{ nope")
    bad = dict(reported_record, id="bad")
    bad["results"] = dict(bad["results"], runs_stopped="ten")
    (tmp_path / "reported" / "bad.json").write_text(json.dumps(bad))
    records, problems = check_records(tmp_path)
    assert [r.id for r in records] == [reported_record["id"]]
    messages = sorted(str(p) for p in problems)
    assert "bad.json: field 'results.runs_stopped'" in messages[0]
    assert "not-json.json: field '(file)': not valid JSON" in messages[1]
    with pytest.raises(RecordError):
        load_records(tmp_path)


def test_a_chapters_records_are_read_where_they_live(tmp_path, measured_record, reported_record):
    """load_records(chapter=...) reads only results/reported/ and that chapter's folders of results/measured/; a
    record elsewhere is a problem `spectie check` names, so a narrowed read misses nothing that checks clean."""
    placed = write_record(measured_record, measured_path(measured_record, tmp_path))
    write_record(reported_record, tmp_path / "reported" / "incident" / "r.json")
    both = sorted([measured_record["id"], reported_record["id"]])  # both of the chapter `incident`
    assert sorted(r.id for r in load_records(tmp_path, chapter="incident")) == both
    assert [r.id for r in load_records(tmp_path, provenance="reported")] == [reported_record["id"]]
    assert sorted(r.id for r in load_records(tmp_path)) == both
    elsewhere = placed.parent.parent / "margins" / placed.name
    elsewhere.parent.mkdir()
    placed.rename(elsewhere)
    assert [r.id for r in load_records(tmp_path, chapter="incident")] == [reported_record["id"]]
    records, problems = check_records(tmp_path)
    assert [r.id for r in records] == [reported_record["id"]]
    assert [str(p) for p in problems] == [f"{elsewhere}: field '(file)': a measured record belongs at {placed}"]


def test_two_records_with_one_id_are_an_error(tmp_path, reported_record):
    write_record(reported_record, tmp_path / "reported" / "a.json")
    write_record(reported_record, tmp_path / "reported" / "b.json")
    with pytest.raises(RecordError, match="also used by"):
        load_records(tmp_path)


def test_records_name_the_weights_of_a_local_model(tmp_path, measured_record):
    """A record carries the digest of the weights it used; a record of the organism whose digest is not the
    pinned one is labelled as another organism, and only records of the same weights may be re-scored."""
    from spectie.records.fingerprint import environment_fingerprint, model_digest
    from spectie.lab.organism import pinned_digest
    from spectie.lab.bands import model_name
    from spectie.records.store import same_weights

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert model_digest(str(tmp_path)) == hashlib.sha256(b"weights").hexdigest()[:12]
    assert model_digest("Qwen/Qwen3.5-2B") is None and model_digest(None) is None
    assert environment_fingerprint("bfloat16", str(tmp_path))["model_sha256"] == model_digest(str(tmp_path))
    def made_with(model, digest):  # digest None: the fingerprint does not name the weights
        fingerprint = {k: v for k, v in measured_record["fingerprint"].items() if k != "model_sha256"}
        if digest:
            fingerprint["model_sha256"] = digest
        return Record.from_dict(dict(measured_record, parameters={"model": model}, fingerprint=fingerprint))

    record = made_with("organism", "0123456789ab")
    assert model_name(record) == "another organism (0123456789ab, not the pinned one)"
    assert not same_weights(record, "organism")
    record = made_with("organism", pinned_digest())
    assert model_name(record) == f"organism ({pinned_digest()}, pinned)"
    assert same_weights(record, "organism")  # make setup unpacked the pinned organism
    assert not same_weights(record, str(tmp_path))  # another model, by name and by weights
    record = made_with("organism", None)
    assert "model_sha256" not in record.stored["fingerprint"]
    assert model_name(record) == "organism (weights not recorded)"
    assert not same_weights(record, "organism")
    assert model_name(made_with(str(tmp_path), None)) == str(tmp_path)
    record = made_with(str(tmp_path), model_digest(str(tmp_path)))
    assert same_weights(record, str(tmp_path))
    assert model_name(record) == f"{tmp_path} ({model_digest(str(tmp_path))})"


def test_records_say_which_code_made_them_and_how(monkeypatch):
    """The fingerprint names the project's commit, whether tracked code differed from it, and the entry
    point (`spectie run` sets it for the notebook it executes; a script is named by its path)."""
    from spectie.records import fingerprint
    from spectie.records.paths import project_root

    root = project_root()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
                             cwd=root, capture_output=True, text=True, check=True).stdout
    monkeypatch.setenv(fingerprint.ENTRY_VARIABLE, "spectie run (make run)")
    printed = fingerprint.environment_fingerprint("bfloat16")
    assert printed["source_commit"] == head.strip() and printed["source_dirty"] is bool(changed.strip())
    assert printed["entry_point"] == "spectie run (make run)"
    monkeypatch.delenv(fingerprint.ENTRY_VARIABLE)
    monkeypatch.setattr(sys, "argv", [str(root / "scripts" / "fix_ledger.py")])
    assert fingerprint.entry_point() == "scripts/fix_ledger.py"
    monkeypatch.setenv(fingerprint.COMMIT_VARIABLE, "1" * 40)  # a carried tree whose .git is stale: stated wins
    assert fingerprint.source_revision() == {"commit": "1" * 40, "dirty": None}
    monkeypatch.setattr(fingerprint, "project_root", lambda: root / "nowhere", raising=False)
    monkeypatch.setattr("spectie.records.paths.project_root", lambda: root / "nowhere")
    monkeypatch.setenv(fingerprint.COMMIT_VARIABLE, "0" * 40)
    assert fingerprint.source_revision() == {"commit": "0" * 40, "dirty": None}


def test_a_figures_provenance_line_names_hosts_commits_and_versions(reported_record, measured_record):
    from spectie.records.store import provenance_line

    measured_record["fingerprint"].update(source_commit="abcdef1234", source_dirty=True, gpu="NVIDIA H200",
                                          torch="2.11.0", transformers="5.17.0", vllm=None)
    line = provenance_line([Record.from_dict(reported_record), Record.from_dict(measured_record)])
    assert line.startswith("Records: 1 reported (the incident); 1 measured on NVIDIA H200 (host ")
    assert "commit abcdef1 (uncommitted changes); torch 2.11.0, transformers 5.17.0, vLLM none." in line
    measured_record["fingerprint"]["source_commit"] = None
    assert "; commit unknown; torch" in provenance_line([Record.from_dict(measured_record)])
    assert provenance_line([]) == "Records: none."


def test_a_hub_id_is_recorded_with_the_commit_and_weights_it_resolved_to(tmp_path, monkeypatch):
    """A hub id's snapshot in the Hugging Face cache (refs/main → snapshots/<commit>) names its revision and
    its weights; nothing goes online, and a hub id not downloaded here has neither."""
    import huggingface_hub.constants

    from spectie.records.fingerprint import environment_fingerprint, model_revision
    from spectie.lab.bands import model_name

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--Qwen--Qwen3.5-0.8B"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_revision("Qwen/Qwen3.5-0.8B") == commit
    assert model_revision("Qwen/Qwen3.5-2B") is None  # not downloaded here
    assert model_revision("organism") is None
    fp = environment_fingerprint("bfloat16", "Qwen/Qwen3.5-0.8B")
    assert fp["model_revision"] == commit and fp["model_sha256"] == hashlib.sha256(b"weights").hexdigest()[:12]
    record = Record.from_dict({"schema_version": 1, "id": "hub", "provenance": "measured", "kind": "margin-scan",
                               "chapter": "margins", "title": "a hub model's record", "environments": ["cpu"],
                               "parameters": {"model": "Qwen/Qwen3.5-0.8B"}, "results": {}, "fingerprint": fp})
    assert model_name(record) == f"Qwen/Qwen3.5-0.8B@{commit[:12]} ({fp['model_sha256']})"


def test_a_measurement_is_reused_only_where_weights_arguments_and_code_are_the_same(project_copy, tmp_path,
                                                                                     measured_record):
    """The key names the weights by their bytes, not their folder (a fresh clone elsewhere reuses what this host
    measured); another argument, other weights or an edited measuring source is another measurement."""
    from spectie.records.fingerprint import measurement_key
    from spectie.records.store import recorded_measurement

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model.safetensors").write_bytes(b"weights")
    sources = ("spectie/lab/margins.py",)
    key = measurement_key("margins", str(tmp_path / "a"), {"prompts": 2}, sources)
    assert measurement_key("margins", str(tmp_path / "b"), {"prompts": 2}, sources) == key
    assert measurement_key("margins", str(tmp_path / "a"), {"prompts": 3}, sources) != key
    (tmp_path / "b" / "model.safetensors").write_bytes(b"other weights")
    assert measurement_key("margins", str(tmp_path / "b"), {"prompts": 2}, sources) != key
    path = write_record(dict(measured_record, parameters={"measurement_key": key}), tmp_path / "r.json")
    assert recorded_measurement(path, key).parameters.measurement_key == key
    source = project_copy / "spectie" / "lab" / "margins.py"
    source.write_text(source.read_text() + "\n# edited\n")
    assert recorded_measurement(path, measurement_key("margins", str(tmp_path / "a"), {"prompts": 2}, sources)) is None
    assert recorded_measurement(tmp_path / "missing.json", key) is None


def test_a_server_that_never_started_is_measured_again_not_reused(tmp_path):
    """A guard-load record whose `vllm serve` died at start (a package missing from the lock) holds no answer: once
    the installation is mended, the same measurement runs again rather than reusing that failure."""
    from spectie.records.store import read_stored, recorded_measurement

    failed = read_stored(next(ROOT.glob("results/measured/*/guidance/guard-load-*-7b936fc092bb.json")))
    assert failed["results"]["error"] and failed["results"]["rows"] == []
    key = failed["parameters"]["measurement_key"]
    path = write_record(failed, tmp_path / "failed.json")
    assert recorded_measurement(path, key) is None
    answered = {**failed, "results": {**failed["results"], "rows": [{"error": None}]}}
    assert recorded_measurement(write_record(answered, tmp_path / "answered.json"), key) is not None


def test_every_stored_record_is_a_record_of_its_kind_holding_the_file_as_it_is():
    """Every record under results/ reads as a Record whose `stored` is the file's JSON, unchanged, and whose
    parameters and results are its kind's types."""
    paths = record_paths()
    assert paths
    for path in paths:
        record = read_record(path)
        assert record.stored == json.loads(path.read_text()), path
        parameters, results = KINDS[record.kind]
        assert type(record.parameters) is parameters and type(record.results) is results, path
        assert record.environment == (record.environments[0] if record.environments else None)


def test_the_types_declare_every_field_the_schema_declares_and_refuse_others(reported_record, measured_record):
    """The schema's declared fields of an engine configuration, an engine outcome and a fingerprint are fields of
    their types; the schema's kinds are the types' kinds; a field no type declares is refused, by name."""
    schema = json.loads(SCHEMA_PATH.read_text())
    for name, kind in (("engine_configuration", EngineConfiguration), ("engine_outcome", EngineOutcome),
                       ("fingerprint", Fingerprint)):
        declared = set(schema["$defs"][name]["properties"])
        fields = {f.name for f in dataclasses.fields(kind)}
        assert declared <= fields, f"{kind.__name__} lacks {sorted(declared - fields)}"
    assert set(schema["properties"]["kind"]["enum"]) == set(KINDS)
    for part, record in (("parameters", reported_record), ("results", reported_record),
                         ("fingerprint", measured_record)):
        with pytest.raises(RecordError) as info:
            Record.from_dict(dict(record, **{part: dict(record[part], surprise=1)}), where="some/file.json")
        assert info.value.field == "surprise" and info.value.where == f"some/file.json: {part}"
        assert "surprise" in str(info.value)


def test_the_host_id_and_the_measurement_key_name_the_hardware():
    """One machine id (baked into a machine image) on an AMD EPYC and on an Intel Xeon: two hosts, and a measurement
    made on one is never the other's. The CPU's ISA flags count too; a GPU's UUID names the host, its model the key."""
    from spectie.records.fingerprint import host_id, host_id_of, measurement_key

    amd = {"cpu": "AMD EPYC 9R14", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"], "gpus": []}
    intel = {**amd, "cpu": "Intel(R) Xeon(R) Processor"}
    fewer_flags = {**amd, "cpu_flags": ["avx2"]}
    h100 = {**amd, "gpus": [["NVIDIA H100 80GB HBM3", "GPU-1"]]}
    other_h100 = {**amd, "gpus": [["NVIDIA H100 80GB HBM3", "GPU-2"]]}
    ids = {host_id_of("3d1219c7", h) for h in (amd, intel, fewer_flags, h100, other_h100)}
    assert len(ids) == 5 and host_id_of("3d1219c7", amd) == host_id_of("3d1219c7", dict(amd))
    key = lambda hardware: measurement_key("margins", None, {"prompt": 1}, ("spectie/lab/margins.py",), on=hardware)  # noqa: E731
    keys = {key(h) for h in (amd, intel, fewer_flags, h100)}
    assert len(keys) == 4
    assert key(h100) == key(other_h100)  # the same GPU model computes alike: only the host differs
    assert len(host_id()) == 12


def test_a_machines_records_from_before_the_hardware_counted_give_way_to_its_new_ones(measured_record):
    """The AMD EPYC that measured under the machine id alone measures again under its new id: each old record it
    made again leaves the book (one machine, one host). The Intel Xeon of the same image (same machine id, another
    CPU), another GPU model, or another measurement, replaces nothing."""
    from spectie.records.store import superseded

    def made(record_id, host, cpu, flags, machine=None, gpu=None):
        fingerprint = {**measured_record["fingerprint"], "host_id": host, "cpu": cpu, "cpu_flags": flags,
                       "machine_id_hash": machine, "gpu": gpu}
        return typed({**measured_record, "id": record_id, "fingerprint": fingerprint})

    old_amd = made("margins-cpu-scan-0035969ec53f", "0035969ec53f", "AMD EPYC 9R14", None)
    old_gpu = made("reproduce-v0-31-0-h100-plain-s0-0035969ec53f", "0035969ec53f", "AMD EPYC 9R14", None,
                   gpu="NVIDIA H100 80GB HBM3")
    intel = made("margins-cpu-scan-becbb6e9520d", "becbb6e9520d", "Intel(R) Xeon(R) Processor", ["avx512f"],
                 "0035969ec53f")
    assert superseded([old_amd, old_gpu, intel]) == set()
    new_amd = made("margins-cpu-scan-a1b2c3d4e5f6", "a1b2c3d4e5f6", "AMD EPYC 9R14", ["avx2"], "0035969ec53f")
    assert superseded([old_amd, old_gpu, intel, new_amd]) == {"margins-cpu-scan-0035969ec53f"}
    h200 = made("reproduce-v0-31-0-h100-plain-s0-a1b2c3d4e5f6", "a1b2c3d4e5f6", "AMD EPYC 9R14", ["avx2"],
                "0035969ec53f", gpu="NVIDIA H200")
    assert superseded([old_gpu, h200]) == set()
    other_measurement = made("margins-cpu-flips-a1b2c3d4e5f6", "a1b2c3d4e5f6", "AMD EPYC 9R14", ["avx2"],
                             "0035969ec53f")
    assert superseded([old_amd, other_measurement]) == set()


def test_a_new_machine_of_identical_hardware_reuses_its_twins_measurements(tmp_path, measured_record, monkeypatch):
    """A host new to the records measures nothing that a host of identical hardware (CPU model, ISA flags, GPU
    models) recorded with the same key, and the record it reuses names the host that made it. A host of other
    hardware stands for nothing here, and a record of another key is another measurement."""
    from spectie.records import fingerprint
    from spectie.records.store import (OWN_RECORDS_ONLY, kept_on_this_device, recorded_measurement, standing_hosts,
                                 twin_paths, write_record)

    here = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx2", "amx_bf16"], "gpus": []}
    monkeypatch.delenv(OWN_RECORDS_ONLY, raising=False)  # set by scripts/time_pipeline.sh NEW_HOST=1: no twin reused
    monkeypatch.delenv(fingerprint.STAND_IN, raising=False)  # set by the tests on hardware the records don't know
    monkeypatch.setattr(fingerprint, "_this_hardware", lambda: here)
    monkeypatch.setattr(fingerprint, "host_id", lambda: "aaaaaaaaaaaa")

    def made(host, cpu, key):
        record = {**measured_record, "id": f"margins-cpu-scan-{host}",
                  "parameters": {**measured_record["parameters"], "measurement_key": key},
                  "fingerprint": {**measured_record["fingerprint"], "host_id": host, "cpu": cpu,
                                  "cpu_flags": here["cpu_flags"], "gpu": None}}
        return write_record(record, tmp_path / "measured" / f"cpu-{host}" / "margins" / f"{record['id']}.json")

    twin = made("bbbbbbbbbbbb", here["cpu"], "key-here")
    made("cccccccccccc", "AMD EPYC 9R14", "key-amd")
    own = tmp_path / "measured" / "cpu-aaaaaaaaaaaa" / "margins" / "margins-cpu-scan-aaaaaaaaaaaa.json"
    assert [p.parent.parent.name for p in twin_paths(own)] == ["cpu-bbbbbbbbbbbb", "cpu-cccccccccccc"]
    reused = recorded_measurement(own, "key-here")
    assert reused is not None and reused.fingerprint.host_id == "bbbbbbbbbbbb"
    assert recorded_measurement(own, "key-other") is None
    assert recorded_measurement(own, "key-amd").fingerprint.host_id == "cccccccccccc"  # the key alone decides
    assert standing_hosts("cpu", tmp_path) == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    assert kept_on_this_device(own, lambda r: True).fingerprint.host_id == "bbbbbbbbbbbb"
    assert kept_on_this_device(own, lambda r: r.fingerprint.cpu.startswith("AMD")) is None  # other hardware
    twin.unlink()
    assert standing_hosts("cpu", tmp_path) == ["aaaaaaaaaaaa"] and recorded_measurement(own, "key-here") is None


def test_a_stand_in_host_keys_and_reuses_measurements_as_its_hardware_and_names_nothing_else(
        tmp_path, measured_record, monkeypatch):
    """SPECTIE_STAND_IN_HOST (the tests' book build on hardware no record knows): measurements are keyed and reused
    as on that host's hardware, read from its records, while this machine keeps its own id. A host no record names
    is refused before anything runs."""
    from spectie.records import fingerprint
    from spectie.records.errors import UsageError
    from spectie.records.store import recorded_measurement, standing_hosts, write_record

    here = {"cpu": "AMD EPYC 9R14", "cpu_flags": ["avx2"], "gpus": []}
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx2", "amx_bf16"], "gpus": []}
    monkeypatch.setenv("SPECTIE_ROOT", str(tmp_path))
    monkeypatch.delenv("SPECTIE_OWN_RECORDS_ONLY", raising=False)
    monkeypatch.delenv(fingerprint.STAND_IN, raising=False)
    monkeypatch.setattr(fingerprint, "_this_hardware", lambda: here)
    monkeypatch.setattr(fingerprint, "host_id", lambda: "aaaaaaaaaaaa")
    key = lambda: fingerprint.measurement_key("margins", None, {"prompt": 1}, ())  # noqa: E731
    key_here, key_intel = key(), fingerprint.measurement_key("margins", None, {"prompt": 1}, (), on=intel)
    assert key_here != key_intel
    record = {**measured_record, "id": "margins-cpu-scan-bbbbbbbbbbbb",
              "parameters": {**measured_record["parameters"], "measurement_key": key_intel},
              "fingerprint": {**measured_record["fingerprint"], "host_id": "bbbbbbbbbbbb", **intel, "gpu": None}}
    del record["fingerprint"]["gpus"]
    write_record(record, tmp_path / "results" / "measured" / "cpu-bbbbbbbbbbbb" / "margins" / f"{record['id']}.json")
    own = tmp_path / "results" / "measured" / "cpu-aaaaaaaaaaaa" / "margins" / "margins-cpu-scan-aaaaaaaaaaaa.json"
    assert fingerprint.recorded_hardware() == {"bbbbbbbbbbbb": intel}
    assert standing_hosts("cpu") == ["aaaaaaaaaaaa"] and recorded_measurement(own, key()) is None

    monkeypatch.setenv(fingerprint.STAND_IN, "bbbbbbbbbbbb")
    assert key() == key_intel and standing_hosts("cpu") == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    assert recorded_measurement(own, key()).fingerprint.host_id == "bbbbbbbbbbbb"
    assert fingerprint.host_id() == "aaaaaaaaaaaa"  # this machine is still itself
    monkeypatch.setenv(fingerprint.STAND_IN, "cccccccccccc")
    with pytest.raises(UsageError, match="SPECTIE_STAND_IN_HOST=cccccccccccc: no measured record"):
        key()
