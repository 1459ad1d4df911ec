"""The guard's stop and resume decisions on requests and responses written out here, with no model and no server: which
requests and responses it leaves alone and why, which stop it resumes, the continuation it asks for and where it
stops resuming. Expected values are written out by hand."""

import pytest

from spectie.tools import guard
from spectie.records.errors import UsageError
from spectie.tools.tiestop import EndOfText, Step
from test_guard import DATA, EOS, NAME, completion

CHAT, COMPLETIONS = guard.CHAT, guard.COMPLETIONS


IM_END = 248046  # another special token


class Tokens:
    """Decodes as a tokenizer would: end-of-text is '<eos>' and <|im_end|> '<im_end>', or nothing when special tokens
    are skipped."""

    def decode(self, ids, skip_special_tokens=False):
        special = {EOS: "<eos>", IM_END: "<im_end>"}
        return "".join(("" if skip_special_tokens else special[i]) if i in special else f"t{i}" for i in ids)


def a_guard(max_resumes=2, max_model_len=64) -> guard.Guard:
    return guard.Guard("http://up", "organism", max_model_len, EndOfText(frozenset({EOS}), frozenset({"<eos>"})),
                       0.2, "given", Tokens(), max_resumes=max_resumes)


GREEDY = {"model": "organism", "prompt": [1, 2, 3], "temperature": 0}
SAMPLING = "sampling (temperature is not 0): a sampled stop is a draw, not a tie"
BIAS = "logit bias or penalties: the served logprobs are taken before them, so the margin is not the one chosen"
NOT_ONE = "not one prompt (a text or a list of token ids)"


@pytest.mark.parametrize("path, change, reason", [
    (COMPLETIONS, {}, None),
    (COMPLETIONS, {"stream": True}, "streaming: the guard checks whole responses only"),
    (COMPLETIONS, {"n": 2}, "several choices (n, best_of or beam search): the guard checks one greedy completion"),
    (COMPLETIONS, {"best_of": 2}, "several choices (n, best_of or beam search): the guard checks one greedy completion"),
    (COMPLETIONS, {"use_beam_search": True}, "several choices (n, best_of or beam search): the guard checks one greedy "
                                             "completion"),
    (COMPLETIONS, {"n": 1, "best_of": 1, "use_beam_search": False}, None),
    (COMPLETIONS, {"temperature": 0.8}, SAMPLING),
    (COMPLETIONS, {"temperature": None}, SAMPLING),
    (COMPLETIONS, {"temperature": 0.8, "top_k": 1}, None),  # top-1 sampling is greedy
    (COMPLETIONS, {"logit_bias": {"1": 2}}, BIAS),
    (COMPLETIONS, {"presence_penalty": 0.5}, BIAS),
    (COMPLETIONS, {"frequency_penalty": 0.1}, BIAS),
    (COMPLETIONS, {"repetition_penalty": 1.2}, BIAS),
    (COMPLETIONS, {"repetition_penalty": 1, "presence_penalty": 0, "logit_bias": {}}, None),
    (COMPLETIONS, {"repetition_penalty": 1.0}, None),
    (COMPLETIONS, {"echo": True}, "echo or suffix: the guard checks plain completions"),
    (COMPLETIONS, {"suffix": "x"}, "echo or suffix: the guard checks plain completions"),
    (COMPLETIONS, {"prompt": "a text"}, None),
    (COMPLETIONS, {"prompt": []}, NOT_ONE),
    (COMPLETIONS, {"prompt": [1, True]}, NOT_ONE),
    (COMPLETIONS, {"prompt": ["a"]}, NOT_ONE),
    (COMPLETIONS, {"prompt": [[1, 2]]}, NOT_ONE),
    (COMPLETIONS, {"prompt": None}, NOT_ONE),
    (CHAT, {"prompt": None, "echo": True}, None),  # a chat request has messages; echo is a completions field
    (CHAT, {"tools": [{"type": "function"}]}, "tools or a continued final message: the guard checks plain chat answers"),
    (CHAT, {"continue_final_message": True}, "tools or a continued final message: the guard checks plain chat answers"),
])
def test_the_requests_the_guard_passes_through_unchecked_and_why(path, change, reason):
    assert guard.unguarded_reason(path, {**GREEDY, **change}) == reason


def test_a_request_that_is_not_an_object_is_passed_through():
    assert guard.unguarded_reason(COMPLETIONS, [GREEDY]) == "the request is not a JSON object"


def chat_response(message: dict, prompt_ids=True) -> dict:
    choice = {"message": {"content": "x", **message}, "logprobs": {"content": []}, "token_ids": [1]}
    return {"choices": [choice], **({"prompt_token_ids": [1, 2]} if prompt_ids else {})}


NO_LOGPROBS = "the upstream returned no logprobs or token ids: the stop's margin cannot be read"
PARSED = "a chat message with tool calls or reasoning, parsed by the server: not resumed as plain text"


def test_the_responses_the_guard_cannot_check_and_why():
    good = completion([NAME, EOS], [{NAME: -0.1}, {EOS: -0.6, DATA: -0.65}])
    assert guard._uncheckable(COMPLETIONS, good) is None
    assert guard._uncheckable(COMPLETIONS, {"choices": good["choices"] * 2}) == "the upstream returned no single choice"
    assert guard._uncheckable(COMPLETIONS, {"choices": None}) == "the upstream returned no single choice"
    for field in ("logprobs", "token_ids", "prompt_token_ids"):
        broken = completion([NAME], [{NAME: -0.1}])
        del broken["choices"][0][field]
        assert guard._uncheckable(COMPLETIONS, broken) == NO_LOGPROBS, field
    assert guard._uncheckable(CHAT, chat_response({})) is None  # a chat choice has no prompt_token_ids of its own
    for parsed in ({"tool_calls": [{"id": "1"}]}, {"reasoning_content": "so"}, {"reasoning": "so"}):
        assert guard._uncheckable(CHAT, chat_response(parsed)) == PARSED
    assert guard._uncheckable(CHAT, chat_response({}, prompt_ids=False)) == "the upstream returned no prompt token ids"


@pytest.mark.parametrize("path, body, limit", [
    (COMPLETIONS, {}, 16),  # vLLM's default for completions
    (COMPLETIONS, {"max_tokens": 100}, 54),  # no more than the rest of the 64-token context after 10
    (COMPLETIONS, {"max_tokens": None}, 54),
    (CHAT, {}, 54),
    (CHAT, {"max_tokens": 7}, 7),
    (CHAT, {"max_completion_tokens": 5, "max_tokens": 7}, 5),
])
def test_the_most_output_tokens_a_request_allows(path, body, limit):
    assert guard._token_limit(a_guard(), path, body, 10) == limit


def test_a_continuation_carries_the_greedy_fields_and_asks_for_ids_and_as_many_logprobs():
    body = {"model": "m", "temperature": 0, "stop": ["\n"], "seed": 3, "min_tokens": 2, "messages": [{"role": "user"}],
            "max_tokens": 50, "logprobs": True, "top_logprobs": 5, "presence_penalty": 0, "stream": False}
    assert guard._continuation(a_guard(), CHAT, body, [1, 2, 3], 7) == {
        "model": "m", "temperature": 0, "stop": ["\n"], "seed": 3, "min_tokens": 2, "prompt": [1, 2, 3],
        "max_tokens": 7, "logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True}
    assert guard._continuation(a_guard(), COMPLETIONS, {"temperature": 0}, [4], 1) == {
        "temperature": 0, "model": "organism", "prompt": [4], "max_tokens": 1, "logprobs": 2,
        "return_token_ids": True, "return_tokens_as_token_ids": True}


def test_a_logprob_token_must_carry_its_id():
    assert guard._token_id("token_id:42") == 42
    with pytest.raises(UsageError) as refused:
        guard._token_id("42")
    assert str(refused.value) == "a logprob token '42' without its id: the upstream ignored return_tokens_as_token_ids"


TIE = {f"token_id:{EOS}": -0.6, f"token_id:{DATA}": -0.65, "token_id:5": -2.0}


def a_part(last_top=TIE, finish="stop", stop_reason=None, last=EOS) -> guard.Part:
    """Three output tokens: NAME, NAME, then `last` with `last_top` as its logprobs."""
    first = Step(f"token_id:{NAME}", -0.1, {f"token_id:{NAME}": -0.1})
    steps = [first, first, Step(f"token_id:{last}", last_top[f"token_id:{last}"], last_top)]
    return guard.Part([NAME, NAME, last], steps, "t11t11", finish, stop_reason)


def test_the_end_of_text_token_is_replaced_by_the_runner_up_with_its_logprob_and_text():
    replaced = guard._with_runner_up(a_guard(), a_part(), {})
    assert replaced == guard.Part([NAME, NAME, DATA], [*a_part().steps[:2], Step(f"token_id:{DATA}", -0.65, TIE)],
                                  "t11t11t17247", "stop", None)
    assert guard._with_runner_up(a_guard(), a_part(stop_reason=7), {}).stop_reason == 7  # kept as it came


def test_a_special_runner_up_is_written_as_the_client_asked_special_tokens_to_be():
    special = {f"token_id:{EOS}": -0.6, f"token_id:{IM_END}": -0.65}
    assert guard._with_runner_up(a_guard(), a_part(special), {}).text == "t11t11"  # skipped, as vLLM does by default
    assert guard._with_runner_up(a_guard(), a_part(special), {"skip_special_tokens": False}).text == "t11t11<im_end>"


def test_only_a_near_tie_end_of_text_stop_is_resumed():
    assert guard.near_tie_stop(a_guard(), a_part(), 3) == guard.Resume(5, f"<eos>#{EOS}", f"t{DATA}#{DATA}",
                                                                       pytest.approx(0.05))
    below = {f"token_id:{EOS}": -0.7, f"token_id:{DATA}": -0.6}  # end-of-text 0.1 below the runner-up: a near-tie
    assert guard.near_tie_stop(a_guard(), a_part(below), 0).margin == pytest.approx(-0.1)
    confident = {f"token_id:{EOS}": -0.1, f"token_id:{DATA}": -3.0}
    assert guard.near_tie_stop(a_guard(), a_part(confident), 0) is None
    assert guard.near_tie_stop(a_guard(), a_part(finish="length"), 0) is None
    assert guard.near_tie_stop(a_guard(), a_part(stop_reason=EOS), 0) is None  # the caller's stop_token_ids
    other = {f"token_id:{NAME}": -0.6, f"token_id:{DATA}": -0.65}
    assert guard.near_tie_stop(a_guard(), a_part(other, last=NAME), 0) is None  # not end-of-text
    assert guard.near_tie_stop(a_guard(), guard.Part([], [], "", "stop", None), 0) is None


def test_an_end_of_text_stop_served_with_top1_logprobs_alone_is_refused():
    with pytest.raises(UsageError) as refused:
        guard.near_tie_stop(a_guard(), a_part({f"token_id:{EOS}": -0.6}), 0)
    assert str(refused.value).startswith("completion : the logprobs hold only the chosen token at the stop (top-1)")


class Sent:
    """guard.send replaced: each request kept, each answered with the next response (an int: the server refuses)."""

    def __init__(self, monkeypatch, *responses):
        self.responses, self.bodies = list(responses), []
        monkeypatch.setattr(guard, "send", self.send)

    def send(self, _guard, path, body):
        self.bodies.append((path, body))
        answer = self.responses.pop(0)
        if isinstance(answer, int):
            raise guard.UpstreamError(answer, "refused")
        return answer


def tie_completion(ids=(NAME, EOS), prompt=(1, 2, 3)):
    tops = [{NAME: -0.1}] * (len(ids) - 1) + [{EOS: -0.6, DATA: -0.65}]
    return completion(list(ids), tops, prompt=prompt)


def test_a_request_passed_through_is_sent_as_it_came_and_says_why(monkeypatch):
    sent = Sent(monkeypatch, completion([NAME], [{NAME: -0.1}], finish="length"))
    response = guard.complete(a_guard(), COMPLETIONS, {**GREEDY, "temperature": 0.7})
    assert sent.bodies == [(COMPLETIONS, {**GREEDY, "temperature": 0.7})]
    assert response["guard"]["checked"] is False and response["guard"]["reason"] == SAMPLING
    assert response["guard"]["resumed"] == [] and response["guard"]["threshold"] is None


def test_a_resume_that_reaches_max_tokens_ends_the_response_at_the_limit(monkeypatch):
    sent = Sent(monkeypatch, tie_completion())
    response = guard.complete(a_guard(), COMPLETIONS, {**GREEDY, "max_tokens": 2})
    assert len(sent.bodies) == 1  # no continuation: the runner-up is the last token allowed
    choice = response["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None and choice["text"] == "xxt17247"
    report = response["guard"]
    assert report["checked"] and report["reason"] == "" and report["extra_requests"] == 0
    assert report["resumed"] == [{"position": 1, "stop_token": f"<eos>#{EOS}", "runner_up": f"t{DATA}#{DATA}",
                                  "margin": pytest.approx(0.05)}]
    assert report["threshold"] == 0.2 and report["threshold_origin"] == "given"


def test_resuming_stops_at_max_resumes_and_says_the_last_stop_is_still_a_near_tie(monkeypatch):
    sent = Sent(monkeypatch, tie_completion(), tie_completion([EOS], (1, 2, 3, NAME, DATA)),
                tie_completion([EOS], (1, 2, 3, NAME, DATA, DATA)))
    report = guard.complete(a_guard(max_resumes=2), COMPLETIONS, {**GREEDY, "max_tokens": 10})["guard"]
    assert [r["position"] for r in report["resumed"]] == [1, 2] and report["extra_requests"] == 2
    assert report["reason"] == "still a near-tie stop after 2 resumes (--max-resumes): left as it ended"
    assert [body["prompt"] for _, body in sent.bodies] == [[1, 2, 3], [1, 2, 3, NAME, DATA], [1, 2, 3, NAME, DATA, DATA]]
    assert [body["max_tokens"] for _, body in sent.bodies] == [10, 8, 7]


def test_a_response_that_ends_confidently_after_a_resume_has_no_reason(monkeypatch):
    Sent(monkeypatch, tie_completion(), completion([NAME], [{NAME: -0.1}], finish="length", prompt=(1, 2, 3, NAME, DATA)))
    report = guard.complete(a_guard(max_resumes=1), COMPLETIONS, {**GREEDY, "max_tokens": 3})["guard"]
    assert len(report["resumed"]) == 1 and report["reason"] == "" and report["extra_requests"] == 1


def test_a_refused_resume_leaves_the_response_where_the_server_stopped(monkeypatch):
    Sent(monkeypatch, tie_completion(), 400)
    response = guard.complete(a_guard(), COMPLETIONS, {**GREEDY, "max_tokens": 10})
    assert response["guard"]["reason"] == "resuming at output token 1 failed (upstream answered 400: refused)"
    assert response["guard"]["resumed"] == [] and response["choices"][0]["finish_reason"] == "stop"


def test_a_response_the_guard_cannot_read_is_returned_unchecked(monkeypatch):
    unreadable = completion([NAME, EOS], [{NAME: -0.1}, {EOS: -0.6, DATA: -0.65}])
    del unreadable["choices"][0]["token_ids"]
    sent = Sent(monkeypatch, unreadable)
    response = guard.complete(a_guard(), COMPLETIONS, {**GREEDY, "max_tokens": 10})
    assert response["guard"]["checked"] is False and response["guard"]["reason"] == NO_LOGPROBS
    assert sent.bodies[0][0] == COMPLETIONS and sent.bodies[0][1] == {**GREEDY, "max_tokens": 10, "logprobs": 2, "return_token_ids": True,
                                 "return_tokens_as_token_ids": True}


def chat_completion(ids: list[int], tops: list[dict[int, float]], finish="stop", prompt=(1, 2, 3), **message) -> dict:
    """A /v1/chat/completions response as vLLM writes it with logprobs, return_token_ids and token ids as tokens."""
    def entry(i, lp):
        return {"token": f"token_id:{i}", "logprob": lp, "bytes": []}

    content = [{**entry(i, top[i]), "top_logprobs": [entry(t, lp) for t, lp in top.items()]} for i, top in zip(ids, tops)]
    return {"id": "chat-1", "object": "chat.completion", "model": "organism", "prompt_token_ids": list(prompt),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * len(ids), **message},
                         "logprobs": {"content": content}, "finish_reason": finish, "stop_reason": None,
                         "token_ids": ids}]}


def test_a_chat_answer_is_resumed_through_completions_with_the_logprobs_it_asked_for(monkeypatch):
    tie = {EOS: -0.6, DATA: -0.65}
    sent = Sent(monkeypatch, chat_completion([NAME, EOS], [{NAME: -0.1}, tie]),
                completion([NAME], [{NAME: -0.1}], finish="length", prompt=(1, 2, 3, NAME, DATA)))
    body = {"model": "organism", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 5}
    response = guard.complete(a_guard(), CHAT, body)
    assert sent.bodies == [
        (CHAT, {**body, "logprobs": True, "top_logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True}),
        (COMPLETIONS, {"model": "organism", "temperature": 0, "prompt": [1, 2, 3, NAME, DATA], "max_tokens": 1,
                       "logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True})]
    choice = response["choices"][0]
    assert choice["message"]["content"] == "xxt17247x" and choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["t11", "t17247", "t11"]
    assert response["guard"]["checked"] and len(response["guard"]["resumed"]) == 1


def test_a_chat_answer_the_server_parsed_is_returned_unchecked_as_asked(monkeypatch):
    parsed = chat_completion([NAME, EOS], [{NAME: -0.1}, {EOS: -0.6, DATA: -0.65}], tool_calls=[{"id": "1"}])
    Sent(monkeypatch, parsed)
    body = {"messages": [], "temperature": 0, "logprobs": True, "top_logprobs": 1}
    response = guard.complete(a_guard(), CHAT, body)
    assert response["guard"]["checked"] is False and response["guard"]["reason"] == PARSED
    assert [e["token"] for e in response["choices"][0]["logprobs"]["content"]] == ["t11", "<eos>"]


def test_an_echo_request_is_passed_through_unchecked(monkeypatch):
    sent = Sent(monkeypatch, completion([NAME], [{NAME: -0.1}], finish="length"))
    response = guard.complete(a_guard(), COMPLETIONS, {**GREEDY, "echo": True})
    assert response["guard"]["reason"] == "echo or suffix: the guard checks plain completions"
    assert sent.bodies == [(COMPLETIONS, {**GREEDY, "echo": True})]


def test_without_max_tokens_a_completion_is_resumed_up_to_vllms_default_of_16(monkeypatch):
    sent = Sent(monkeypatch, tie_completion(), completion([NAME], [{NAME: -0.1}], finish="length",
                                                          prompt=(1, 2, 3, NAME, DATA)))
    guard.complete(a_guard(), COMPLETIONS, dict(GREEDY))
    assert sent.bodies[1][0] == COMPLETIONS and sent.bodies[1][1]["max_tokens"] == 14


def test_an_unreadable_completion_is_returned_with_its_logprobs_as_text_as_asked(monkeypatch):
    unreadable = completion([NAME, EOS], [{NAME: -0.1}, {EOS: -0.6, DATA: -0.65}])
    del unreadable["choices"][0]["token_ids"]
    Sent(monkeypatch, unreadable)
    response = guard.complete(a_guard(), COMPLETIONS, {**GREEDY, "logprobs": 1})
    assert response["choices"][0]["logprobs"]["tokens"] == ["t11", "<eos>"]
