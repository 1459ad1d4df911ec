"""Tie-stop detector: parsing each input format, the verdicts, bad input, and the command line."""

import json

import pytest

from conftest import ROOT, run_cli, typed
from spectie.tools import thresholds, tiestop
from spectie.records.errors import UsageError
from spectie.records.record_types import Record


def _logit_comparison(record_id: str, rows: list[dict], **fields) -> Record:
    """A logit-comparison record with the fields a stored one has, cut down to what the thresholds read."""
    return typed({"id": record_id, "kind": "logit-comparison", "chapter": "margins", "results": {"rows": rows},
                  **fields})


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


def test_a_stop_string_is_not_a_tie_question():
    """vLLM says why a completion stopped: `stop_reason` is None for end-of-text, the stop string when the
    caller's `stop` matched. The last token of a stop-string stop was not chosen to end the text."""
    response = completion_response({"": -0.60, "DATA": -0.79})
    response["choices"][0]["stop_reason"] = "\n\n"
    [by_string] = tiestop.from_openai(response)
    verdict = tiestop.check(by_string, threshold=0.5)
    assert not verdict.flagged and verdict.margin is None and "stop string '\\n\\n'" in verdict.explanation
    response["choices"][0]["stop_reason"] = None  # end-of-text: the same margins are a tie question again
    [by_eos] = tiestop.from_openai(response)
    assert tiestop.check(by_eos, threshold=0.5).flagged


def test_only_an_end_of_text_token_is_read_as_the_stop():
    """With the model's end-of-text tokens, a last token that is none of them is not measured as the stop
    (its margin is unread): e.g. logprobs cut short, or a stop the caller's stop_token_ids made."""
    stops = tiestop.EndOfText(frozenset({248044, 248046}), frozenset({"<|endoftext|>", "<|im_end|>"}))
    [chat] = tiestop.from_openai(chat_response(-0.70, -0.72))
    assert tiestop.check(chat, 0.1, stops).flagged  # "<|im_end|>": vLLM's decoded text of the EOS
    for token, stop_reason, read in (("#248046", None, True), ("<|im_end|>#248046", None, True),
                                     ("token_id:248044", None, True), ("DATA#17247", None, False),
                                     ("DATA", None, False), ("DATA#17247", 17247, True), ("token_id:7", 9, False)):
        assert stops.matches(token, stop_reason) is read, (token, stop_reason)
    response = completion_response({"DATA": -0.60, "x": -0.79}, tokens=("a", "b", "DATA"))
    [cut] = tiestop.from_openai(response)
    verdict = tiestop.check(cut, 0.5, stops)
    assert not verdict.flagged and verdict.margin is None and verdict.stop_token == "DATA"
    assert "is not an end-of-text token of the model (<|endoftext|>, <|im_end|> (ids 248044, 248046))" in verdict.explanation
    assert tiestop.check(cut, 0.5).flagged  # without the model's tokens the last token is taken as the stop
    [biased] = tiestop.from_openai(chat_response(-11.0, -0.5))  # a logit bias chose end-of-text (vLLM's logprobs are raw ones: before the bias)
    verdict = tiestop.check(biased, 0.5, stops)
    assert not verdict.flagged and verdict.margin == pytest.approx(-10.5) and "not greedy decoding" in verdict.explanation
    assert "outside the noise band" in verdict.explanation
    [near] = tiestop.from_openai(chat_response(-0.75, -0.5))  # end-of-text 0.25 below the runner-up
    verdict = tiestop.check(near, 0.5, stops)
    assert verdict.flagged and "a near-tie either way" in verdict.explanation
    # Closed: |margin| <= threshold (a served margin of exactly one bf16 step is the closest a non-tie can be).
    assert tiestop.check(near, 0.25, stops).flagged and not tiestop.check(near, 0.2499, stops).flagged


def test_the_organisms_end_of_text_tokens_are_read_from_its_folder():
    from spectie.lab.model import resolve_model

    stops = tiestop.end_of_text(resolve_model("organism"))
    assert stops.ids == {248044, 248046} and {"<|endoftext|>", "<|im_end|>"} <= stops.texts


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


def test_without_a_band_for_these_weights_the_threshold_is_the_incidents_reported_swing():
    """fp32: EOS by 0.67; bf16: DATA by 0.69 (reported): the margin moved 1.36 logits between precisions. A
    random-weight shape's band is never the default (its scale is a free parameter of the random weights)."""
    band, label = thresholds.default_threshold()
    assert band == pytest.approx(1.36) and label.startswith("reported:") and "hf-reference-logits-1854" in label
    record = _logit_comparison("r", [
        {"dtype": "fp32", "margin": 0.2, "winner": "EOS", "logits": {"EOS": 10.2, "DATA": 10.0}},
        {"dtype": "bf16", "margin": 0.1, "winner": "EOS", "logits": {"EOS": 10.1, "DATA": 10.0}}])
    assert thresholds.reported_swing(record)[0] == pytest.approx(0.1)  # same winner: the margins' difference
    assert thresholds.default_threshold(digest="000000000000") == (band, label)


def test_default_threshold_is_the_band_recorded_for_the_same_weights(monkeypatch):
    """The rule, on band points written out here: bf16 with TF32 off, of these weights; the device's own where it
    has one, else the widest of any device; fp32, TF32 and other weights never count; none: the reported swing."""
    from spectie.lab import bands

    def point(band, dtype="bfloat16", tf32=False, digest="aaaaaaaaaaaa", gpu=None):
        return {"band": band, "dtype": dtype, "tf32": tf32, "model_sha256": digest, "gpu": gpu,
                "label": f"{band} on {gpu or 'CPU'}"}

    points = [point(0.10), point(0.25, gpu="NVIDIA H100"), point(0.18, gpu="NVIDIA H100"), point(0.9, dtype="float16"),
              point(0.8, tf32=True), point(0.7, digest="bbbbbbbbbbbb")]
    monkeypatch.setattr(bands, "recorded_band_points", lambda: points)
    assert thresholds.default_threshold(digest="aaaaaaaaaaaa") == (0.25, "bf16 noise band of 0.25 on NVIDIA H100")
    assert thresholds.default_threshold(digest="aaaaaaaaaaaa", device="CPU")[0] == 0.10
    assert thresholds.default_threshold(digest="aaaaaaaaaaaa", device="NVIDIA H100")[0] == 0.25
    assert thresholds.default_threshold(digest="aaaaaaaaaaaa", device="NVIDIA B200")[0] == 0.25  # none there
    assert thresholds.default_threshold(digest="bbbbbbbbbbbb")[0] == 0.7
    assert thresholds.default_threshold(digest="cccccccccccc")[0] == pytest.approx(1.36)  # the reported swing


def test_the_command_line_reads_jsonl_and_says_what_it_flagged(tmp_path):
    lines = [completion_response({"": -0.60, "DATA": -0.79}), chat_response(-0.01, -6.0)]
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    run = lambda *args: run_cli("tiestop", *args)  # noqa: E731
    result = run(str(path), "--threshold", "0.5")
    assert result.returncode == 1, result.stderr  # a finding
    assert "FLAGGED  responses.jsonl:1/0 at output token 3" in result.stdout
    assert "1 of 2 completion(s) flagged" in result.stdout
    assert run(str(path), "--threshold", "0.1").returncode == 0  # nothing inside a narrower band
    verdicts = [json.loads(line) for line in run(str(path), "--json", "--threshold", "0.5").stdout.splitlines()]
    assert [v["flagged"] for v in verdicts] == [True, False]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    result = run(str(broken))
    assert result.returncode == 2 and "broken.jsonl:1: not JSON" in result.stderr
    result = run(str(path), "--model", "organism", "--threshold", "0.5")  # its end-of-text tokens
    assert result.returncode == 0, result.stderr
    assert "stop tokens: <|endoftext|>, <|im_end|> (ids 248044, 248046)" in result.stdout
    assert "UNREAD   responses.jsonl:1/0 at output token 3: the last token with logprobs, ''" in result.stdout
    assert "1 stop(s) could not be read" in result.stdout
    first_line = run(str(path)).stdout.splitlines()[0]  # no model, no threshold: the reported swing, said so
    assert first_line.startswith("threshold 1.360 logits (reported: the EOS-DATA margin moved 1.36")
    help_text = run("--help")
    assert help_text.returncode == 0 and "noise band" in help_text.stdout


def test_the_threshold_is_at_least_one_bf16_step_at_the_recorded_logits():
    """Served margins are differences of bf16 logits: at logits of 16 to 32 they come in steps of 0.125, so a
    band narrower than one step cannot tell a stop that won by one step from a tie."""
    assert [thresholds.bf16_step(x) for x in (20.0, 16.47, 15.8, -3.0)] == [0.125, 0.125, 0.0625, 0.015625]
    assert tiestop.is_near_tie(0.125, 0.125) and tiestop.is_near_tie(-0.125, 0.125)
    assert not tiestop.is_near_tie(0.25, 0.125)
    record = _logit_comparison("m", [{"logits": {"EOS": 19.97, "DATA": 19.98}}, {"logits": {"EOS": 20.0, "DATA": 20.0}}],
                               fingerprint={"model_sha256": "abc"})
    assert thresholds.recorded_logits("abc", [record]) == (20.0, "m")
    assert thresholds.recorded_logits("other", [record]) is None
    threshold, origin = thresholds.step_rule(0.118, "band B", (20.0, "m"))
    assert threshold == 0.125 and origin.startswith("one bf16 step at the logits recorded for these weights (|logit| "
                                                    "up to 20.0, record m), wider than the band B (0.118 logits)")
    assert thresholds.step_rule(0.3, "band B", (20.0, "m")) == (
        0.3, "band B; wider than one bf16 step (0.125) at the logits recorded for these weights")
    assert thresholds.step_rule(0.118, "band B", None) == (0.118, "band B")


def test_the_command_line_flags_the_gpu_stop_of_a_reproduction_record():
    """MTP K=1 on prompt seed 1 through CUDA vLLM 0.26.0 (H200): the end-of-text stop won by one bf16 step."""
    [path] = (ROOT / "results" / "measured").glob("v0.26.0-h200-*/reproduce/reproduce-v0.26.0-h200-incident-mtp-v1-k1-s1-*.json")
    result = run_cli("tiestop", "--record", str(path))
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("threshold 0.125 logits (one bf16 step at the logits recorded for these weights")
    assert "won by 0.125 logits over 'DATA#17247'" in result.stdout
    assert "10 of 10 completion(s) flagged as near-tie stops" in result.stdout
    plain = str(path).replace("-mtp-v1-k1-", "-plain-")  # plain greedy ran to the limit: nothing to flag
    result = run_cli("tiestop", "--record", plain)
    assert result.returncode == 0 and "0 of 10 completion(s) flagged" in result.stdout, result.stderr
