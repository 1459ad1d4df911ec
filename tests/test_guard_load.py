"""The load measurement's plan and parameters (spectie.engines.guard_load), and what its records are made to say
(spectie.book.guard_load_page). The real servers run in `make run CHAPTER=guidance PARAMS=environments/runs/*-guard-load.yaml`
(tests/test_served.py runs the proxy in front of a real vllm serve)."""

import pytest

from conftest import typed
from spectie.engines import guard_load
from spectie.book import guard_load_page
from spectie.records.errors import UsageError

GOOD = dict(servers=["plain", "mtp-k1"], levels=[1, 8], seeds=[0, 5], survey_prompts=2, survey_tokens=16,
            copies_seeds=[0], prefix_caching=[False, True])


@pytest.mark.parametrize("change, message", [
    ({"servers": ["mtp-k3"]}, "load_servers must be a list of distinct values"),
    ({"prefix_caching": ["on"]}, "load_prefix_caching must be a list"),
    ({"levels": [8, 64]}, "load_levels must include 1"),
    ({"levels": [1, 0]}, "load_levels must be an integer >= 1"),
    ({"levels": [1, 1000]}, "from 1 to 256"),
    ({"copies_seeds": [3]}, "must be among load_seeds"),
    ({"seeds": [], "copies_seeds": [], "survey_prompts": 0}, "needs prompts"),
    ({"survey_tokens": 0}, "load_survey_tokens must be an integer >= 1"),
])
def test_bad_parameters_are_refused_before_any_server_starts(change, message):
    guard_load.check_arguments(**GOOD)
    with pytest.raises(UsageError, match=message):
        guard_load.check_arguments(**{**GOOD, **change})


def test_each_level_sends_every_prompt_and_its_batches_of_copies():
    items = [guard_load.Item(label, [1, 2], 4) for label in ("seed-0", "seed-5", "survey-1")]
    plan = guard_load.batches(items, [64, 1, 8], [0, 5])
    assert [(level, name, len(requests)) for level, name, requests in plan] == [
        (1, "distinct", 3), (8, "distinct", 8), (8, "copies", 8), (8, "copies", 8),
        (64, "distinct", 64), (64, "copies", 64), (64, "copies", 64)]
    assert {r.label for r in plan[1][2]} == {"seed-0", "seed-5", "survey-1"}
    assert {r.label for r in plan[3][2]} == {"seed-5"}


def load_record(server: str, cache: bool, rows: list[tuple], fingerprint: dict | None = None,
                error: str | None = None) -> object:
    """A guard-load record whose rows are (level, route, prompt, finish_reason, output_tokens, digest); on a CPU
    unless `fingerprint` says otherwise, of a server that started unless `error` says why not."""
    fingerprint = fingerprint or {"host_id": "h", "cpu": "a CPU"}
    return typed({"id": f"guard-load-{server}-{cache}-{fingerprint['host_id']}", "kind": "guard-load",
                  "chapter": "guidance", "environments": ["cpu"], "fingerprint": fingerprint,
                  "parameters": {"server": server, "prefix_caching": cache},
                  "results": {"error": error, "batches": [], "rows": [
                      {"level": level, "workload": "distinct", "route": route, "prompt": prompt, "error": None,
                       "finish_reason": finish, "output_tokens": tokens, "digest": digest, "seconds": 1.0,
                       "near_tie_stop": finish == "stop" and tokens < 96, "resumed": 0}
                      for level, route, prompt, finish, tokens, digest in rows]}})


def test_what_load_and_prefix_caching_changed_is_counted_against_the_right_reference():
    plain = load_record("plain", False, [(1, "straight", "seed-0", "length", 96, "A"),
                                         (8, "straight", "seed-0", "length", 96, "A")])
    mtp = load_record("mtp-k1", False, [(1, "straight", "seed-0", "length", 96, "A"),
                                        (8, "straight", "seed-0", "stop", 10, "B"),
                                        (8, "straight", "seed-0", "length", 96, "A")])
    cached = load_record("mtp-k1", True, [(1, "straight", "seed-0", "stop", 10, "B")])
    rows = {(c["server"], c["prefix caching"], c["level"]): c for c in guard_load_page.cells([plain, mtp, cached])}
    assert rows[("mtp-k1", "off", 8)]["earlier than plain"] == 1
    assert rows[("mtp-k1", "off", 8)]["differ from one at a time"] == 1
    assert rows[("mtp-k1", "off", 1)]["earlier than plain"] == 0 and rows[("plain", "off", 8)]["earlier than plain"] == 0
    assert rows[("mtp-k1", "on", 1)]["earlier than plain"] == 1
    assert guard_load_page.cache_effect([plain, mtp, cached]) == (1, 1)
    assert guard_load_page.settings([plain, mtp, cached]) == ("mtp-k1 with prefix caching on and off; plain with "
                                                              "prefix caching off")
    text = guard_load_page.load_sentence("cpu, a CPU (host h)", [plain, mtp, cached])
    assert "1 of 3 answers under load differed" in text and "1 stopped earlier than plain greedy under load" in text
    assert "with prefix caching on, 1 of 1 one-at-a-time answers (mtp-k1) differed" in text
    calm = guard_load_page.load_sentence("d", [plain])
    assert "0 of 1 answers under load differed" in calm and "with prefix caching on, " not in calm  # no pair to compare
    assert calm.endswith("not run yet there: plain, mtp-k1 and mtp-k8 with prefix caching on; mtp-k1 and mtp-k8 with "
                         "prefix caching off (make run CHAPTER=guidance ENV=cpu PARAMS=environments/runs/cpu-guard-load"
                         ".yaml)")
    assert "changed answers there" in guard_load_page.checklist_text([plain, mtp, cached])
    assert "neither load nor prefix caching changed an answer" in guard_load_page.checklist_text([plain])
    assert "not measured on a GPU yet" in guard_load_page.summary_values([plain, mtp])["guard_devices"].text


def test_a_device_whose_servers_all_failed_to_start_measured_nothing_and_is_said_so():
    """A GPU whose every server failed to start (the records keep vLLM's error, and no row) is not a device where
    0 of 0 answers stopped: each sentence says nothing was measured there and why, and the first page still says the
    guard is not measured on a GPU; one answered request there would make it a measured device."""
    error = "vllm serve: ModuleNotFoundError: No module named 'x'; r/entry.py\", line 137, in build ^^^^ File \".venvs"
    gpu = {"host_id": "g", "gpu": "NVIDIA H100 80GB HBM3", "source_commit": "30dbd9e13b974bf2"}
    broken = [load_record(server, True, [], gpu, error) for server in ("plain", "mtp-k1")]
    cpu = load_record("plain", False, [(1, "straight", "seed-0", "length", 96, "A")])
    said = guard_load_page.load_sentence("gpu", broken)
    assert said == ("on gpu: nothing measured: 2 of 2 servers did not start (vllm serve: ModuleNotFoundError: No module"
                    " named 'x'), and no request was answered")
    assert "nothing measured: 2 of 2 servers" in guard_load_page.checklist_text([cpu, *broken])
    assert guard_load_page.failed(broken) == ["on cpu, NVIDIA H100 80GB HBM3 (host g), mtp-k1 (prefix caching on) and "
                                              "plain (prefix caching on): vllm serve: ModuleNotFoundError: No module "
                                              "named 'x' (project at commit 30dbd9e)"]
    assert guard_load_page.settings([cpu, *broken]) == "plain with prefix caching off"  # a server that answered
    line = guard_load_page.summary_values([cpu, *broken])["guard_devices"].text
    assert "(host g): nothing measured: 2 of 2" in line and "not measured on a GPU yet" in line
    answered = load_record("plain", True, [(1, "straight", "seed-0", "length", 96, "A")], {**gpu, "host_id": "k"})
    assert "not measured on a GPU yet" not in guard_load_page.summary_values([cpu, answered])["guard_devices"].text
    line = guard_load_page.summary_values([cpu, answered, *broken])["guard_devices"].text  # same GPU, another host
    assert "(host k)" in line and "(host g)" not in line and "nothing measured" not in line


def test_the_guards_added_seconds_keep_their_sign_and_zero_has_none():
    assert [guard_load_page.signed(v) for v in (-0.004, 0.004, -0.21, 0.745)] == ["+0.00", "+0.00", "-0.21", "+0.74"]


def test_a_device_short_of_the_full_plan_says_what_is_not_run_yet_and_how():
    gpu = {"host_id": "g", "gpu": "NVIDIA H100 80GB HBM3"}
    ran = [load_record(server, True, [(1, "straight", "seed-0", "length", 96, "A")], gpu) for server in ("plain",)]
    assert guard_load_page.not_run(ran) == ("not run yet there: mtp-k1 and mtp-k8 with prefix caching on; plain, "
                                            "mtp-k1 and mtp-k8 with prefix caching off (make run CHAPTER=guidance "
                                            "ENV=cpu PARAMS=environments/runs/cpu-guard-load.yaml)")
    full = [load_record(s, c, [], gpu) for s in ("plain", "mtp-k1", "mtp-k8") for c in (True, False)]
    assert guard_load_page.not_run(full) == ""


def test_a_host_without_plain_greedy_compares_no_stop_with_it_and_two_hosts_compare_prefix_caching():
    """On a host that ran MTP alone there is no plain greedy answer: no stop is counted as earlier than it (the
    table shows none, not 0). Prefix caching on (one host) against off (another host of the same GPU model) is compared
    per server, naming both hosts; where one host measured both, its own sentence says it and nothing crosses hosts."""
    gpu = {"host_id": "a", "gpu": "NVIDIA H100 80GB HBM3"}
    on = load_record("mtp-k1", True, [(1, "straight", "seed-0", "stop", 10, "B"),
                                      (1, "straight", "seed-1", "length", 96, "C")], gpu)
    off = load_record("mtp-k1", False, [(1, "straight", "seed-0", "length", 96, "A"),
                                        (8, "straight", "seed-0", "stop", 10, "B"),
                                        (1, "straight", "seed-1", "length", 96, "C")], {**gpu, "host_id": "b"})
    assert {c["earlier than plain"] for c in guard_load_page.cells([off])} == {None}
    text = guard_load_page.load_sentence("b", [off])
    assert "no plain greedy answer was recorded there, so no stop is compared with plain greedy's" in text
    assert "stopped earlier than plain" not in text and "1 of 1 answers under load differed" in text
    assert guard_load_page.cache_across_hosts([on, off]) == [
        "on cpu, NVIDIA H100 80GB HBM3, across two hosts: mtp-k1 with prefix caching on (host a) and off (host b): 1 of "
        "2 one-at-a-time answers differed"]
    both = load_record("mtp-k1", False, [(1, "straight", "seed-0", "length", 96, "A")], gpu)
    assert guard_load_page.cache_across_hosts([on, off, both]) == []
    other_gpu = load_record("mtp-k1", False, [(1, "straight", "seed-0", "length", 96, "A")],
                            {"host_id": "c", "gpu": "H200"})
    assert guard_load_page.cache_across_hosts([on, other_gpu]) == []
    # Each host's sentence names what the other host of its GPU recorded (not what a host of another GPU did).
    assert guard_load_page.load_sentence("b", [off], [on, off, other_gpu]).endswith(
        "(make run CHAPTER=guidance ENV=cpu PARAMS=environments/runs/cpu-guard-load.yaml); host a, with the same GPU "
        "model, recorded mtp-k1 with prefix caching on")
    assert "with the same GPU model" not in guard_load_page.not_run([on], [on, other_gpu])


def test_the_command_that_runs_what_is_missing_names_the_environments_own_run_file():
    assert guard_load_page.run_file("cpu") == "cpu-guard-load.yaml"
    assert guard_load_page.run_file("v0.32.0-h100") == "v0.32.0-h100-guard-load.yaml"
    assert guard_load_page.run_file("v0.32.0-h200") == "v0.32.0-h100-guard-load.yaml"  # none of its own: the release's
