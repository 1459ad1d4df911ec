"""Host checks of `make run` and the tie-stop survey (real vLLM on the organism)."""

import os
import stat
import subprocess

import pytest

from conftest import run_cli, run_main, survey_near_tie, this_hosts_records, typed
from spectie.lab import host, prompts
from spectie.engines import survey
from spectie.book import guidance_survey
from spectie.records.environments import get_environment
from spectie.records.errors import UsageError
from spectie.records.fingerprint import Gpu
from spectie.records.record_types import Record
from spectie.records.store import read_record, validate_record


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that answers the query as an H200 host does (its output format)."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.03, GPU-0, 143771, 143000'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return script


@pytest.fixture
def fake_rtx4090x2(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that answers as a host with two RTX 4090 and a driver other than the
    reporter's (591.44, named by v0.31.0-rtx4090x2), with almost no free memory."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 4090, 580.95.05, GPU-0, 24564, 1'\n"
                      "echo 'NVIDIA GeForce RTX 4090, 580.95.05, GPU-1, 24564, 1'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return script


def test_gpus_are_read_from_nvidia_smi(fake_nvidia_smi):
    [gpu] = host.gpus()
    assert gpu == Gpu("NVIDIA H200", "580.159.03", "GPU-0", 143771 * 2**20, 143000 * 2**20)


def test_a_gpu_environment_on_a_host_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(host, "gpus", lambda: [])
    with pytest.raises(UsageError, match="'h200' is a NVIDIA H200 host, but this host has no NVIDIA GPU"):
        host.check("margins", get_environment("h200"), {"model": "organism", "device": "cuda"})


def test_a_gpu_run_labelled_cpu_and_a_wrong_gpu_are_refused(fake_nvidia_smi):
    with pytest.raises(UsageError, match="environment 'cpu' has no GPU"):
        host.check("margins", get_environment("cpu"), {"model": "organism", "device": "cuda"})
    with pytest.raises(UsageError, match="this host's GPU is NVIDIA H200"):
        host.check("reproduce", get_environment("v0.32.0-rtx4090"), {"model": "organism"})


def test_a_matching_host_passes_and_says_what_it_has(fake_nvidia_smi):
    lines = host.check("margins", get_environment("h200"), {"model": "organism", "device": "cuda"})
    assert lines[0] == "GPU: 1 x NVIDIA H200, driver 580.159.03, 139.6 of 140.4 GiB free on the first"
    assert lines[1].startswith("model: organism, needs about 0.") and "GiB free on the GPU" in lines[1]


def test_a_gpu_environment_without_the_overrides_the_gpu_runs_needed_is_flagged_with_the_reason():
    """The project's GPU runs of vLLM needed the triton GDN prefill and vLLM's own sampler (no flashinfer): an
    environment that sets neither is flagged for the chapters that run vLLM, one line each, saying why."""
    said = host.override_lines("reproduce", {"id": "my-4090", "hardware": {"gpu": "NVIDIA GeForce RTX 4090"}})
    assert [line.split(" under ")[0] for line in said] == ["environment my-4090 sets no gdn_prefill_backend",
                                                          "environment my-4090 sets no VLLM_USE_FLASHINFER_SAMPLER"]
    assert "fails to start" in said[0] and "environments/my-4090.yaml" in said[0]
    set_both = {"id": "x", "hardware": {"gpu": "H100"}, "engine": {"gdn_prefill_backend": "triton"},
                "engine_environment": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}}
    assert host.override_lines("reproduce", set_both) == []
    assert host.override_lines("margins", {"id": "x", "hardware": {"gpu": "H100"}}) == []  # runs no vLLM
    assert host.override_lines("guidance", {"id": "cpu", "hardware": {"gpu": None}}) == []  # the CPU build


def without_gpu(monkeypatch, main, *args: str) -> subprocess.CompletedProcess:
    """A command line's `main(args)` in this process with no nvidia-smi on PATH; it must stop with a usage error
    (exit 2)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    result = run_main(main, *args)
    assert result.returncode == 2, result.stderr
    return result


def test_a_gpu_environment_computed_on_the_cpu_is_refused(fake_nvidia_smi):
    """ENV=h200 without DEVICE=cuda would label CPU numbers as the H200's."""
    with pytest.raises(UsageError, match="device 'cpu': environment 'h200' is a NVIDIA H200 host"):
        host.check("margins", get_environment("h200"), {"model": "organism", "device": "cpu"})


def test_bench_runs_the_host_checks_before_any_model(monkeypatch):
    """`make bench DEVICE=cuda` on a host without a GPU (its ENV defaults to cpu) stops at the host check."""
    from spectie.lab import bench

    result = without_gpu(monkeypatch, bench.main, "--env", "cpu", "--device", "cuda")
    assert "environment 'cpu' has no GPU" in result.stderr and "benchmark:" not in result.stdout


def test_another_driver_is_recorded_unless_the_check_is_strict(fake_rtx4090x2):
    env = get_environment("v0.31.0-rtx4090x2")
    lines = host.check("incident", env, {})
    assert lines == ["GPU: 2 x NVIDIA GeForce RTX 4090, driver 580.95.05, 0.0 of 24.0 GiB free on the first",
                     "environment 'v0.31.0-rtx4090x2' names driver 591.44 (reported), this host has 580.95.05: "
                     "recorded, not enforced"]
    with pytest.raises(UsageError, match="names driver 591.44, this host has 580.95.05") as refused:
        host.check("incident", env, {}, strict=True)
    assert "not enforced" not in str(refused.value)


def test_another_gpu_model_is_refused_even_when_not_strict(fake_nvidia_smi):
    with pytest.raises(UsageError, match="'v0.31.0-rtx4090x2' is a NVIDIA GeForce RTX 4090 host, but this host's "
                                         "GPU is NVIDIA H200"):
        host.check("incident", get_environment("v0.31.0-rtx4090x2"), {}, strict=False)


def test_make_run_is_strict_about_the_driver_only_when_asked(fake_rtx4090x2, monkeypatch):
    """`spectie run` passes SPECTIE_STRICT_HOST=1 to the host check. The fake GPUs have no free memory, so
    both runs stop at the host check; only the strict one counts the driver among the problems."""
    results = []
    for flag in ("", "1"):
        monkeypatch.setenv("SPECTIE_STRICT_HOST", flag)
        results.append(run_cli("run", "margins", "--env", "v0.31.0-rtx4090x2", "--set", "device=cuda"))
    lenient, strict = results
    for result in (lenient, strict):
        assert result.returncode == 2, result.stderr
        assert "model 'organism' needs about" in result.stderr and "running chapter" not in result.stdout
    assert "names driver 591.44 (reported), this host has 580.95.05: recorded, not enforced" in lenient.stderr
    assert "names driver 591.44, this host has 580.95.05" in strict.stderr and "not enforced" not in strict.stderr


def test_a_model_larger_than_memory_is_refused_before_loading(monkeypatch):
    from spectie.lab import memory

    monkeypatch.setattr(host, "gpus", lambda: [])
    monkeypatch.setattr(memory, "host_memory", lambda: 4 * 2**30)
    with pytest.raises(UsageError, match=r"model 'qwen3.5-9b-shape' needs about \d+\.\d GiB in float32, only 4.0 GiB"):
        host.check("reduction_order", get_environment("cpu"), {"model": "qwen3.5-9b-shape", "device": "cpu"})
    with pytest.raises(UsageError, match="is neither a folder with a config.json nor a hub id"):
        host.check("margins", get_environment("cpu"), {"model": "/nonexistent/model", "device": "cpu"})
    import huggingface_hub.constants  # offline, as a host without the hub: read when imported, so set on the module

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match="cannot read the config of model 'Qwen/Qwen3.5-2B'"):
        host.check("margins", get_environment("cpu"), {"model": "Qwen/Qwen3.5-2B", "device": "cpu"})


def test_make_run_checks_the_host_before_running(monkeypatch):
    """On this CPU host an H200 environment is refused by `spectie run` before papermill starts."""
    from spectie import cli

    result = without_gpu(monkeypatch, cli.main, "run", "margins", "--env", "h200")
    assert "this host does not fit the run" in result.stderr and "no NVIDIA GPU" in result.stderr
    assert "running chapter" not in result.stdout


def test_survey_prompts_are_ordinary_and_checked():
    specs = prompts.prompt_specs(10)
    assert [s.tokens for s in specs[:5]] == [256, 512, 1024, 1536, 256]
    assert {s.template for s in specs} == {"raw", "chat"} and len({s.seed for s in specs}) == 10
    assert all((s.tokens, s.seed) != (1845, 0) for s in specs)  # not the incident's prompt
    with pytest.raises(UsageError, match="whole number of prompts"):
        prompts.prompt_specs(0)


def completion(ids, finish="stop", margin=None, top2=None):
    stop = None if margin is None else {"position": len(ids) - 1, "stop_token": "e", "runner_up": "x", "margin": margin}
    return {"finish_reason": finish, "output_tokens": len(ids), "token_ids": ids, "stop_margin": stop,
            "top2_margins": top2 or [3.0] * (len(ids) - 1) + ([margin] if margin is not None else [3.0])}


def _survey(kind: str, parameters: dict, results: dict) -> Record:
    """A record of the survey's `kind` with the fields a stored one has, cut down to what the test reads."""
    return typed({"id": f"{kind}-test", "kind": kind, "chapter": "guidance", "parameters": parameters,
                  "results": results})


def test_tally_separates_ordinary_from_moved_stops():
    record = _survey("tiestop-survey", {"baseline": "plain"}, {"prompts": [
        {"completions": {"plain": completion([1, 2], margin=5.0), "mtp": completion([1, 2], margin=5.0)}},
        {"completions": {"plain": completion([1, 2], margin=0.05, top2=[4.0, 0.05]),
                         "mtp": completion([1, 3], margin=0.01, top2=[4.0, 0.01])}},
        {"completions": {"plain": completion([1, 2, 3], "length"), "mtp": completion([1, 2, 3], "length")}},
    ]})
    record.results.prompts[1]["completions"]["ngram"] = completion([1, 3], margin=0.02, top2=[4.0, 0.02])
    counts = survey.tally(record, threshold=0.1)
    assert counts["completions"] == 7 and counts["stopped_completions"] == 5 and counts["not_stopped"] == 2
    # Each stop once: mtp's copy of plain's first stop is that stop; mtp and ngram wrote the same moved output.
    assert counts["stops"] == 3 and counts["ordinary_stops"] == 2 and counts["ordinary_flagged"] == 1
    assert counts["moved"] == 2 and counts["moved_stops"] == 1 and counts["moved_flagged"] == 1
    assert counts["false_positive_rate"] == pytest.approx(1 / 2) and counts["ordinary_margin_min"] == 0.05
    assert counts["moved_tie_at_divergence"] == 2  # the margins where mtp and ngram parted from plain (position 1)
    assert counts["margin_resolution"] == 0.01
    assert survey.margins_by_kind(record) == {"ordinary": [5.0, 0.05], "moved": [0.01]}
    del record.results.prompts[2]["completions"]["plain"]  # without the baseline nothing can be told
    with pytest.raises(UsageError, match="prompt 2: no completion of the baseline 'plain'"):
        survey.tally(record, threshold=0.1)


def planted(offered: bool, eos: float, other: float, position: int = 0) -> dict:
    return {"position": position, "eos": eos, "eos_id": 9, "other": other, "other_id": 5, "offered": offered}


def test_the_detectors_rates_count_ordinary_stops_and_planted_truncations():
    ordinary = _survey("tiestop-survey", {"baseline": "plain"}, {"prompts": [
        {"completions": {"plain": completion([1, 2], margin=5.0)}},
        {"completions": {"plain": completion([1, 2], margin=0.05)}}]})
    injection = _survey(survey.INJECTION_KIND, {}, {"prompts": [{"positions": [
        planted(True, -0.69, -0.69), planted(True, -0.75, -0.63),  # near-ties: margins 0 and -0.12
        planted(False, -9.0, -0.01), planted(False, -3.0, -0.2)]}]})  # confident: margins -8.99 and -2.8
    rates = survey.detector_rates(ordinary, injection, 0.1)
    assert rates["ordinary_stops"] == 2 and rates["ordinary_flagged"] == 1 and rates["false_positive_rate"] == 0.5
    assert rates["near-tie planted"] == 2 and rates["near-tie caught"] == 1 and rates["confident caught"] == 0
    curve = survey.detector_curve(ordinary, injection, [0.1, 0.2, 3.0, 10.0])
    assert [r["near-tie caught"] for r in curve] == [1, 2, 2, 2]
    assert [r["confident caught"] for r in curve] == [0, 0, 1, 2]
    assert [r["ordinary_flagged"] for r in curve] == [1, 1, 1, 2]
    text = guidance_survey.detector_text(rates, curve)
    assert text.startswith("it caught 1 of 2 (too few for a rate) truncations planted at near-ties and 0 of 2 (too few")
    assert "from a threshold of 3.00 logits, where it would flag 1 of 2 (too few for a rate) ordinary stops" in text
    assert "no injected truncations" in guidance_survey.detector_text(survey.detector_rates(ordinary, None, 0.1), [])
    assert "no ordinary stop was recorded" in guidance_survey.detector_text(survey.detector_rates(None, injection, 0.1), curve)


def test_real_injected_truncations_on_the_organism(tmp_path):
    """The organism's bf16 logprobs where end-of-text is planted: the grammar's designed tie is a near-tie, the
    other positions are confident, and the record says which weights and dtype it came from."""
    from spectie.lab.model import resolve_model
    from spectie.lab.organism import pinned_digest

    record = survey.inject(resolve_model("organism"), "cpu", count=1, new_tokens=16, model_label="organism",
                           progress=False, results_dir=tmp_path)
    validate_record(record.stored)
    assert record.fingerprint.model_sha256 == pinned_digest() and record.parameters.dtype == "bfloat16"
    positions = record.results.prompts[0]["positions"]
    assert len(positions) == 16
    offered = [p for p in positions if p["offered"]]
    assert [p["position"] for p in offered] == [11]  # after "tim\n[DATA] id=42 name=" (prompts.py's grammar)
    assert abs(offered[0]["eos"] - offered[0]["other"]) < 0.25 and offered[0]["eos"] > -1.0
    assert all(p["other"] - p["eos"] > 1.0 for p in positions if not p["offered"])
    with pytest.raises(UsageError, match="whole number of new tokens"):
        survey.inject(resolve_model("organism"), "cpu", count=1, new_tokens=0)


def test_this_hosts_survey_through_vllm_cpu(request):
    """The product path, as this host recorded it: the CPU build of vLLM completed the guidance chapter's batch of
    ordinary prompts, plain and MTP (this host's survey record: conftest.this_hosts_records; the stand-in's on
    hardware no record knows)."""

    [path] = this_hosts_records(request, "guidance/tiestop-survey-cpu-*.json")
    record = read_record(path)
    assert record.kind == "tiestop-survey" and record.results.backend == "cpu"
    assert record.results.vllm_version == "0.32.0"
    assert {c["status"] for c in record.results.configurations.values()} == {"ok"}
    rows = record.results.prompts
    assert len(rows) == 24 and len({r["prompt_tokens"] for r in rows}) > 1
    for row in rows:
        assert set(row["completions"]) == {"plain", "mtp-k1", "mtp-k8"}
        for c in row["completions"].values():
            assert c["output_tokens"] == len(c["token_ids"]) > 0
            assert (c["stop_margin"] is not None) == (c["finish_reason"] == "stop")
    from spectie.lab.model import resolve_model
    from spectie.tools.thresholds import detector_threshold_for_model

    threshold = detector_threshold_for_model(resolve_model("organism"))[0]  # the guard's, as test_served reads it
    counts = survey.tally(record, threshold=threshold)
    assert counts["completions"] == 72 and counts["stops"] == counts["ordinary_stops"] + counts["moved_stops"]
    # The near-tie stop tests/test_served.py serves (where this host's survey has one; which completion stops at a
    # tie is the host's finding): the stopped completion ends on end-of-text at the stop's position.
    found = survey_near_tie(record, threshold)
    if found is not None:
        configuration, (tokens, seed), stop = found
        [row] = [r["completions"] for r in rows if (r["tokens"], r["seed"]) == (tokens, seed)]
        assert row[configuration]["token_ids"][stop["position"]] == 248044  # end-of-text
        assert row[configuration]["output_tokens"] == stop["position"] + 1


def test_a_failing_nvidia_smi_is_an_error_where_nvidia_devices_exist(tmp_path, monkeypatch):
    """Not "no GPU" (then the CPU's noise band would serve a GPU host): the command and its stderr are said."""
    from spectie.records import fingerprint

    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch' >&2\nexit 18\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr("glob.glob", lambda pattern: ["/dev/nvidia0"] if pattern.startswith("/dev/nvidia") else [])
    with pytest.raises(UsageError, match="nvidia-smi --query-gpu.* failed with exit code 18: Failed to initialize NVML"):
        host.gpus()
    with pytest.raises(UsageError, match="exit code 18"):
        fingerprint.device_name()
    # Without NVIDIA devices the host has no GPU, and a GPU environment's check says why nvidia-smi found none.
    monkeypatch.setattr("glob.glob", lambda pattern: [])
    assert host.gpus() == []
    with pytest.raises(UsageError, match="has no NVIDIA GPU .`nvidia-smi .* exit code 18: Failed to initialize NVML"):
        host.check("reproduce", get_environment("v0.32.0-h100"), {})
