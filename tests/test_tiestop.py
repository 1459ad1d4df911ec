"""Tie-stop detector: parsing each input format, the verdicts, bad input, and the command line."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from spectie import tiestop
from spectie.errors import UsageError


def completion_response(last_top: dict, finish_reason="stop", tokens=("a", "b", "")):
    """A /v1/completions response shaped like vllm serve's (logprobs=2); the last token is the stop."""
    lps = [-0.1, -0.2, last_top[tokens[-1]]]
    tops = [{"a": -0.1, "x": -3.0}, {"b": -0.2, "y": -2.5}, last_top]
    return {"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": "ab", "finish_reason": finish_reason,
         "logprobs": {"tokens": list(tokens), "token_logprobs": lps, "top_logprobs": tops, "text_offset": [0, 1, 2]}}]}


def chat_response(stop_lp, runner_lp, finish_reason="stop"):
    content = [{"token": "DATA", "logprob": -0.05, "top_logprobs": [{"token": "DATA", "logprob": -0.05},
                                                                    {"token": "x", "logprob": -4.0}]},
               {"token": "<|im_end|>", "logprob": stop_lp, "top_logprobs": [{"token": "<|im_end|>", "logprob": stop_lp},
                                                                            {"token": "\n", "logprob": runner_lp}]}]
    return {"id": "chat-1", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "DATA"}, "finish_reason": finish_reason,
         "logprobs": {"content": content}}]}


def test_a_stop_that_won_by_less_than_the_threshold_is_flagged():
    [close] = tiestop.from_openai(completion_response({"": -0.60, "DATA": -0.79}))
    verdict = tiestop.check(close, threshold=0.5)
    assert verdict.flagged and verdict.position == 2 and verdict.runner_up == "DATA"
    assert verdict.margin == pytest.approx(0.19)
    [clear] = tiestop.from_openai(completion_response({"": -0.01, "DATA": -5.0}))
    assert not tiestop.check(clear, threshold=0.5).flagged


def test_chat_completions_and_non_stops():
    [chat] = tiestop.from_openai(chat_response(-0.70, -0.72))
    verdict = tiestop.check(chat, 0.1)
    assert chat.source == "openai chat completion" and verdict.flagged and verdict.stop_token == "<|im_end|>"
    [length] = tiestop.from_openai(chat_response(-0.70, -0.72, finish_reason="length"))
    verdict = tiestop.check(length, 0.1)
    assert not verdict.flagged and verdict.margin is None and "no stop to check" in verdict.explanation


def test_missing_or_top1_logprobs_are_refused_with_how_to_request_them():
    response = completion_response({"": -0.6, "DATA": -0.8})
    response["choices"][0]["logprobs"] = None
    [bare] = tiestop.from_openai(response)
    with pytest.raises(UsageError, match=r"no logprobs.*\"logprobs\": 2"):
        tiestop.check(bare, 0.1)
    [top1] = tiestop.from_openai(completion_response({"": -0.6}))
    with pytest.raises(UsageError, match="only the chosen token.*runner-up"):
        tiestop.check(top1, 0.1)
    with pytest.raises(UsageError, match="not an OpenAI-compatible response"):
        tiestop.from_openai({"error": "x"})


def test_default_threshold_is_the_band_of_the_nearest_recorded_size():
    band, label = tiestop.default_threshold("9B")
    assert "qwen3.5-9b-shape" in label and 0.3 < band < 1.5
    band_small, label_small = tiestop.default_threshold("30M")
    assert "organism" in label_small and band_small < band
    with pytest.raises(UsageError, match="give parameters like 9B"):
        tiestop.default_threshold("nine")


def test_the_command_line_reads_jsonl_and_says_what_it_flagged(tmp_path):
    lines = [completion_response({"": -0.60, "DATA": -0.79}), chat_response(-0.01, -6.0)]
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "spectie", "tiestop", *args], cwd=ROOT,
                                       capture_output=True, text=True)
    result = run(str(path), "--threshold", "0.5")
    assert result.returncode == 0, result.stderr
    assert "FLAGGED  responses.jsonl:1/0 at output token 2" in result.stdout
    assert "1 of 2 completion(s) flagged" in result.stdout
    assert run(str(path), "--threshold", "0.5", "--fail-on-flag").returncode == 1
    verdicts = [json.loads(line) for line in run(str(path), "--json", "--threshold", "0.5").stdout.splitlines()]
    assert [v["flagged"] for v in verdicts] == [True, False]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    result = run(str(broken))
    assert result.returncode == 2 and "broken.jsonl:1: not JSON" in result.stderr
    help_text = run("--help")
    assert help_text.returncode == 0 and "noise band" in help_text.stdout
