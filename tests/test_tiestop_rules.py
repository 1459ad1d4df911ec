"""The tie-stop detector's readers and rules on inputs written out here: vLLM RequestOutputs, reproduction records,
JSONL logs and malformed responses, each refused with where it is wrong; its verdicts in words; the end-of-text tokens
it reads from a model folder. Expected values are written out by hand."""

import json
from types import SimpleNamespace

import pytest

from conftest import typed
from spectie.tools import tiestop
from spectie.records.errors import UsageError
from spectie.tools.tiestop import Completion, EndOfText, Step


def refusal(call, *args) -> str:
    with pytest.raises(UsageError) as refused:
        call(*args)
    return str(refused.value)


def logprob(value: float, text: str | None):
    return SimpleNamespace(logprob=value, decoded_token=text)


def test_a_vllm_request_output_is_read_token_by_token_with_ids():
    first = SimpleNamespace(index=0, token_ids=[5, 7], finish_reason="stop", stop_reason=None, logprobs=[
        {5: logprob(-0.1, "a"), 6: logprob(-2.0, "b")}, {7: logprob(-0.5, None), 8: logprob(-0.6, "c")}])
    second = SimpleNamespace(index=1, token_ids=[9], finish_reason="length", logprobs=None)  # no stop_reason field
    output = SimpleNamespace(request_id="req-1", outputs=[first, second])
    assert tiestop.from_request_output(output) == [
        Completion([Step("a#5", -0.1, {"a#5": -0.1, "b#6": -2.0}), Step("#7", -0.5, {"#7": -0.5, "c#8": -0.6})],
                   "stop", "vllm RequestOutput", "req-1/0", None),
        Completion([], "length", "vllm RequestOutput", "req-1/1", None)]
    output.outputs = [SimpleNamespace(index=0, token_ids=[], finish_reason="stop", stop_reason="\n\n", logprobs=[])]
    assert tiestop.from_request_output(output)[0].stop_reason == "\n\n"


REPEAT = {"token_ids": [5, 7], "top2_margins": [1.5, None], "finish_reason": "stop", "stop_reason": None,
          "stop_margin": {"stop_token": "<|endoftext|>#7", "runner_up": "DATA#17247", "margin": 0.125}}


def reproduction(repeats):
    return typed({"id": "rec", "results": {"repeats": repeats, "status": "failed"}})


def test_a_reproduction_record_is_read_one_completion_per_repeat():
    other = {"token_ids": [0, 6], "top2_margins": [None, 2.0], "finish_reason": "length", "stop_reason": 9}
    assert tiestop.from_record(reproduction([REPEAT, other])) == [
        Completion([Step("#5", 0.0, {"#5": 0.0, "runner-up": -1.5}),
                    Step("<|endoftext|>#7", 0.0, {"<|endoftext|>#7": 0.0, "DATA#17247": -0.125})],
                   "stop", "reproduction record", "rec repeat 1", None),
        Completion([Step("#0", 0.0, {"#0": 0.0}), Step("#6", 0.0, {"#6": 0.0, "runner-up": -2.0})],
                   "length", "reproduction record", "rec repeat 2", 9)]
    [stop] = tiestop.from_record(reproduction([REPEAT]))
    verdict = tiestop.check(stop, 0.125)
    assert verdict.flagged and verdict.margin == 0.125 and verdict.runner_up == "DATA#17247"


def test_what_is_not_a_reproduction_record_is_refused():
    said = "record 'rec': not a reproduction record (kind engine-outcome, with repeats)"
    comparison = typed({"id": "rec", "kind": "logit-comparison", "chapter": "margins", "results": {"rows": []}})
    assert refusal(tiestop.from_record, comparison) == said
    assert refusal(tiestop.from_record, reproduction(None)) == said
    assert refusal(tiestop.from_record, reproduction([])) == (
        "record 'rec': no repeats to check (status 'failed': the configuration wrote nothing)")


@pytest.mark.parametrize("change, said", [
    ({"token_ids": [1, -1]}, "results.repeats[1].token_ids[1]: expected a token id (an integer >= 0), got int -1"),
    ({"token_ids": [True]}, "results.repeats[1].token_ids[0]: expected a token id (an integer >= 0), got bool true"),
    ({"token_ids": [1.0]}, "results.repeats[1].token_ids[0]: expected a token id (an integer >= 0), got float 1.0"),
    ({"token_ids": "12"}, "results.repeats[1].token_ids: expected a list, got str \"12\""),
    ({"top2_margins": "x"}, "results.repeats[1].top2_margins: expected a list, got str \"x\""),
    ({"top2_margins": [None, "x"]}, "results.repeats[1].top2_margins[1]: expected a number, got str \"x\""),
    ({"stop_margin": 5}, "results.repeats[1].stop_margin: expected an object, got int 5"),
    ({"stop_margin": {**REPEAT["stop_margin"], "stop_token": 1}},
     "results.repeats[1].stop_margin.stop_token: expected a token (text), got int 1"),
    ({"stop_margin": {**REPEAT["stop_margin"], "runner_up": None}},
     "results.repeats[1].stop_margin.runner_up: expected a token (text), got NoneType null"),
    ({"stop_margin": {**REPEAT["stop_margin"], "margin": None}},
     "results.repeats[1].stop_margin.margin: expected a number, got NoneType null"),
    ({"finish_reason": 3}, "results.repeats[1].finish_reason: expected text or null, got int 3"),
])
def test_a_malformed_repeat_is_refused_naming_the_field(change, said):
    record = reproduction([REPEAT, {**REPEAT, **change}])
    assert refusal(tiestop.from_record, record) == f"record 'rec': {said}"


def test_malformed_repeats_are_refused_naming_the_record():
    assert refusal(tiestop.from_record, reproduction([REPEAT, 7])) == (
        "record 'rec': results.repeats[1]: expected an object, got int 7")
    assert refusal(tiestop.from_record, reproduction({"a": 1})) == (
        "record 'rec': results.repeats: expected a list, got dict {\"a\": 1}")


def test_a_value_is_quoted_by_its_type_and_its_first_forty_characters():
    assert refusal(tiestop._number, "x" * 38, "w") == f"w: expected a number, got str \"{'x' * 38}\""  # 40 in JSON
    assert refusal(tiestop._number, "x" * 39, "w") == f"w: expected a number, got str \"{'x' * 38}x…"
    assert refusal(tiestop._number, {1}, "w") == "w: expected a number, got set \"{1}\""
    for bad in (True, float("nan"), float("inf"), None):
        assert refusal(tiestop._number, bad, "w").startswith("w: expected a number, got ")
    assert tiestop._number(-1, "w") == -1.0 and isinstance(tiestop._number(-1, "w"), float)


def chat(content) -> dict:
    return {"id": "c", "choices": [{"index": 0, "message": {}, "finish_reason": "stop", "logprobs": {"content": content}}]}


@pytest.mark.parametrize("content, said", [
    ("abc", "content: expected a list, got str \"abc\""),
    ([5], "content[0]: expected an object, got int 5"),
    ([{"token": "a", "logprob": -0.1, "top_logprobs": "x"}], "content[0].top_logprobs: expected a list, got str \"x\""),
    ([{"token": "a", "logprob": -0.1, "top_logprobs": [3]}], "content[0].top_logprobs[0]: expected an object, got int 3"),
    ([{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": 3, "logprob": -1.0}]}],
     "content[0].top_logprobs[0].token: expected a token (text), got int 3"),
    ([{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "b", "logprob": "x"}]}],
     "content[0].top_logprobs[0].logprob: expected a number, got str \"x\""),
    ([{"token": 4, "logprob": -0.1}], "content[0].token: expected a token (text), got int 4"),
    ([{"token": "a", "logprob": None}], "content[0].logprob: expected a number, got NoneType null"),
])
def test_a_malformed_chat_logprob_is_refused_naming_where(content, said):
    assert refusal(tiestop.from_openai, chat(content)) == f"response: choices[0].logprobs.{said}"


def test_a_chat_completion_without_top_logprobs_has_steps_with_no_alternatives():
    [completion] = tiestop.from_openai(chat([{"token": "a", "logprob": -0.1}]))
    assert completion.steps == [Step("a", -0.1, {})] and completion.source == "openai chat completion"


def test_a_jsonl_log_that_is_missing_empty_or_not_json_is_refused(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert refusal(tiestop.read_jsonl, missing) == f"no such file: {missing}"
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert refusal(tiestop.read_jsonl, binary) == f"{binary}: not UTF-8 text"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert refusal(tiestop.read_jsonl, empty) == f"{empty}: no completions in it (an empty or truncated log is not a pass)"
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n{not json\n")
    assert refusal(tiestop.read_jsonl, broken) == (
        f"{broken}:2: not JSON (Expecting property name enclosed in double quotes)")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000)
    assert refusal(tiestop.read_jsonl, deep) == f"{deep}:1: not JSON (nested too deeply)"


def test_every_line_of_a_jsonl_log_is_read_and_named_by_file_and_line(tmp_path):
    line = '{"id": "x", "choices": [{"index": 0, "finish_reason": "length", "logprobs": null}]}'
    path = tmp_path / "log.jsonl"
    path.write_text(f"{line}\n\n{line}\n")
    assert [c.request for c in tiestop.read_jsonl(str(path))] == ["log.jsonl:1/0", "log.jsonl:3/0"]


def test_a_decoded_token_with_a_line_break_is_still_read_by_its_id():
    stops = EndOfText(frozenset({248044}), frozenset({"<|endoftext|>"}))
    assert stops.matches("\n#248044") and not stops.matches("\n#5")


def test_the_threshold_must_be_a_margin_of_zero_or_more():
    [completion] = tiestop.from_openai(chat([{"token": "a", "logprob": -0.5, "top_logprobs": [
        {"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.5}]}]))
    assert refusal(tiestop.check, completion, -0.1) == "the threshold must be a margin in logits >= 0, got -0.1"
    assert refusal(tiestop.check, completion, float("nan")) == "the threshold must be a margin in logits >= 0, got nan"
    assert tiestop.check(completion, 0.0).flagged  # an exact tie is a near-tie at a threshold of 0


def test_a_stop_string_stop_is_not_flagged():
    stopped = Completion([Step("a", -0.5, {"a": -0.5, "b": -0.5})], "stop", "test", stop_reason="\n")
    assert tiestop.check(stopped, 0.5).flagged is False


def completion_logprobs(**logprobs) -> dict:
    return {"choices": [{"index": 0, "finish_reason": "stop", "logprobs": logprobs}]}


@pytest.mark.parametrize("logprobs, said", [
    ({"token_logprobs": []}, ": completion logprobs without 'tokens'"),
    ({"tokens": []}, ": completion logprobs without 'token_logprobs'"),
    ({"tokens": "ab", "token_logprobs": []}, ".tokens: expected a list, got str \"ab\""),
    ({"tokens": [], "token_logprobs": 1}, ".token_logprobs: expected a list, got int 1"),
    ({"tokens": [], "token_logprobs": [], "top_logprobs": "x"}, ".top_logprobs: expected a list, got str \"x\""),
    ({"tokens": ["a", "b"], "token_logprobs": [-0.1]}, ": 2 tokens but 1 token_logprobs and 0 top_logprobs"),
    ({"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{}]},
     ": 2 tokens but 2 token_logprobs and 1 top_logprobs"),
    ({"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [3]}, ".top_logprobs[0]: expected an object, got int 3"),
    ({"tokens": [4], "token_logprobs": [-0.1]}, ".tokens[0]: expected a token (text), got int 4"),
    ({"tokens": ["a"], "token_logprobs": ["x"]}, ".token_logprobs[0]: expected a number, got str \"x\""),
    ({"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{5: -0.1}]},
     ".top_logprobs[0] key: expected a token (text), got int 5"),
    ({"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": None}]},
     ".top_logprobs[0]['a']: expected a number, got NoneType null"),
])
def test_a_malformed_completion_logprob_is_refused_naming_where(logprobs, said):
    assert refusal(tiestop.from_openai, completion_logprobs(**logprobs)) == f"response: choices[0].logprobs{said}"


def test_completion_logprobs_without_alternatives_have_steps_with_none():
    [bare] = tiestop.from_openai(completion_logprobs(tokens=["a", "b"], token_logprobs=[-0.1, -0.2]))
    assert bare.steps == [Step("a", -0.1, {}), Step("b", -0.2, {})]
    [gap] = tiestop.from_openai(completion_logprobs(tokens=["a", "b"], token_logprobs=[-0.1, -0.2],
                                                     top_logprobs=[None, {"b": -0.2, "c": -0.3}]))
    assert gap.steps == [Step("a", -0.1, {}), Step("b", -0.2, {"b": -0.2, "c": -0.3})]


def test_the_stop_margin_of_a_record_replaces_its_last_step_only():
    [completion] = tiestop.from_record(reproduction([{**REPEAT, "token_ids": [5, 6, 7], "top2_margins": [1.5, 2.0, None]}]))
    assert completion.steps == [Step("#5", 0.0, {"#5": 0.0, "runner-up": -1.5}),
                                Step("#6", 0.0, {"#6": 0.0, "runner-up": -2.0}),
                                Step("<|endoftext|>#7", 0.0, {"<|endoftext|>#7": 0.0, "DATA#17247": -0.125})]


def stop(margin: float, finish="stop", stop_reason=None, token="E") -> Completion:
    """A one-token completion ending on `token`, `margin` logits over (or under) its runner-up 'D'."""
    return Completion([Step(token, -1.0, {token: -1.0, "D": -1.0 - margin})], finish, "test", stop_reason=stop_reason)


BELOW = ("sampling, a logit bias or penalty, or a bug forcing the stop (the premature end-of-text of vLLM #41467) "
         "chose it, not greedy decoding; ")


@pytest.mark.parametrize("margin, threshold, explanation", [
    (-10.5, 0.5, f"the stop token 'E' is 10.500 logits below 'D' in the logprobs: {BELOW}outside the noise band, not a "
                 "tie: compare with plain greedy (spectie classify)"),
    (-0.25, 0.5, f"the stop token 'E' is 0.250 logits below 'D' in the logprobs: {BELOW}within the noise band, a "
                 "near-tie either way"),
    (0.0, 0.5, "the stop token 'E' won by 0.000 logits over 'D': inside the noise band, a near-tie another computation "
               "shape could flip"),
    (0.75, 1.0, "the stop token 'E' won by 0.750 logits over 'D': inside the noise band, a near-tie another computation "
                "shape could flip"),
    (2.0, 1.0, "the stop token 'E' won by 2.000 logits over 'D': outside the noise band"),
])
def test_each_verdict_says_how_far_the_stop_won_or_lost_and_what_that_means(margin, threshold, explanation):
    assert tiestop.check(stop(margin), threshold).explanation == explanation


def test_what_is_no_stop_or_a_stop_string_is_said_and_never_flagged():
    verdict = tiestop.check(stop(0.0, finish="length"), 0.5)
    assert verdict.flagged is False and verdict.explanation == "finish_reason 'length': no stop to check"
    verdict = tiestop.check(stop(0.0, stop_reason="\n"), 0.5)
    assert verdict.flagged is False and verdict.explanation == (
        "stopped by the stop string '\\n' the caller gave, not by a token the model chose to end with: not a tie question")


def test_a_stop_on_the_callers_stop_token_id_is_read_and_any_other_token_is_not():
    stops = EndOfText(frozenset({1}), frozenset({"<e>"}))
    assert tiestop.check(stop(0.1, stop_reason=17, token="x#17"), 0.5, stops).margin == pytest.approx(0.1)
    verdict = tiestop.check(stop(0.1, token="x#17"), 0.5, stops)
    assert verdict.margin is None and verdict.unread and verdict.explanation == (
        "the last token with logprobs, 'x#17', is not an end-of-text token of the model (<e> (ids 1)): the logprobs do "
        "not reach the token that stopped generation, so its margin cannot be read")




def test_an_openai_choice_is_named_by_the_request_else_the_response_id_and_its_index():
    response = {"id": "cmpl-9", "choices": [{"finish_reason": "length"}, {"index": 4, "finish_reason": None}]}
    assert [c.request for c in tiestop.from_openai(response)] == ["cmpl-9/0", "cmpl-9/4"]
    assert [c.request for c in tiestop.from_openai(response, "log:3")] == ["log:3/0", "log:3/4"]
    del response["id"]
    [first, second] = tiestop.from_openai(response)
    assert first == Completion([], "length", "openai completion", "/0", None) and second.finish_reason is None


def test_a_malformed_openai_choice_is_refused_naming_where():
    assert refusal(tiestop.from_openai, {"choices": 3}) == "response: choices: expected a list, got int 3"
    assert refusal(tiestop.from_openai, {"choices": [1]}) == "response: choices[0]: expected an object, got int 1"
    assert refusal(tiestop.from_openai, {"choices": [{"logprobs": "x"}]}) == "response: choices[0].logprobs: expected an object, got str \"x\""
    assert refusal(tiestop.from_openai, {"choices": [{"finish_reason": 3}]}) == "response: choices[0].finish_reason: expected text or null, got int 3"


def model_folder(tmp_path, eos, added=None):
    added = added if added is not None else [{"id": 7, "content": "<a>", "special": True},
                                             {"id": 8, "content": "c", "special": False},
                                             {"id": 9, "content": "<b>", "special": True}]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": added, "model": {"vocab": {}}}))
    return tmp_path


@pytest.mark.parametrize("eos, expected", [
    ([7, 9], EndOfText(frozenset({7, 9}), frozenset({"<a>", "<b>"}))),
    (7, EndOfText(frozenset({7}), frozenset({"<a>"}))),
    (8, None),  # not a special token: its text is whatever the tokenizer decodes it to
    ([7, 8], None), ([], None), (None, None), (["7"], None), ([7, True], None), ("7", None),
])
def test_the_end_of_text_tokens_of_a_folder_that_names_special_tokens(tmp_path, eos, expected):
    assert tiestop.special_end_of_text(model_folder(tmp_path, eos)) == expected


def test_a_folder_that_does_not_say_it_that_way_has_no_special_end_of_text(tmp_path):
    assert tiestop.special_end_of_text(tmp_path) is None  # no files
    model_folder(tmp_path, [7])
    (tmp_path / "generation_config.json").write_text("{not json")
    assert tiestop.special_end_of_text(tmp_path) is None
    model_folder(tmp_path, [7])
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {}}))  # no added tokens
    assert tiestop.special_end_of_text(tmp_path) is None
    assert tiestop.special_end_of_text(model_folder(tmp_path, [7], added=[{"id": 7, "content": "<a>"}])) is None


def test_without_special_tokens_the_end_of_text_is_read_through_the_tokenizer(monkeypatch, tmp_path):
    from spectie.lab import tokenizer

    class Tokens:
        def decode(self, ids):
            return "".join(f"d{i}" for i in ids)

        def convert_ids_to_tokens(self, ids):
            return [f"c{i}" for i in ids]

    asked = []
    monkeypatch.setattr(tokenizer, "model_tokenizer", lambda path: asked.append(path) or Tokens())
    monkeypatch.setattr(tokenizer, "end_of_text_ids", lambda path, tokens: [3, 4] if isinstance(tokens, Tokens) else [])
    assert tiestop.end_of_text(str(tmp_path)) == EndOfText(frozenset({3, 4}), frozenset({"d3", "d4", "c3", "c4"}))
    assert asked == [str(tmp_path)]
    assert tiestop.end_of_text(str(model_folder(tmp_path, 7))) == EndOfText(frozenset({7}), frozenset({"<a>"}))
    assert len(asked) == 1  # a folder that names its special tokens needs no tokenizer
