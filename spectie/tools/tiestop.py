"""Tie-stop detector: flag a completion whose stop token won by less than the noise band.

A completion requested with top-2 logprobs carries, at its last position, the logprob of the stop token
and of the best other token. Their difference is the logit margin by which the stop won (logprobs of one
position share their normaliser). A margin inside the bf16 noise band (measured in the reduction-order
chapter) means that another computation shape, such as a different speculative verify width, could as
well have continued: the stop is a near-tie, and the output may be silently truncated. The rule reads the margin
in either order (`is_near_tie`): a stop token just below the runner-up was not chosen by greedy decoding, but it
is a near-tie all the same. A stop far below the runner-up (forced by a bug) is not a tie and is not flagged: the
comparison with plain greedy (`spectie classify`) finds it; the guidance chapter measures both.

Inputs: vLLM `RequestOutput` objects (offline `LLM.generate` with `SamplingParams(logprobs=2)`),
OpenAI-compatible responses of `vllm serve` (completions with `"logprobs": 2`, chat completions with
`"logprobs": true, "top_logprobs": 2`), and JSONL files of such responses. The caller's only cost is the
logprobs request.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from spectie.records.errors import UsageError

HOW_TO_REQUEST = ("request top-2 logprobs: SamplingParams(logprobs=2) offline; \"logprobs\": 2 for /v1/completions; "
                  "\"logprobs\": true, \"top_logprobs\": 2 for /v1/chat/completions")


@dataclass(frozen=True)
class Step:
    """One generated position: the chosen token and its logprob, and the top alternatives offered."""
    token: str
    logprob: float
    top: dict[str, float]  # token -> logprob, as returned (may include the chosen token)


@dataclass(frozen=True)
class Completion:
    """What the detector reads from one completion, whatever format it came in."""
    steps: list[Step]
    finish_reason: str | None
    source: str  # e.g. "vllm RequestOutput", "openai completion", "openai chat completion"
    request: str = ""  # an id or index naming the completion in its input
    stop_reason: object = None  # vLLM's: None for end-of-text, the stop string or stop token id the caller gave


@dataclass(frozen=True)
class Verdict:
    flagged: bool
    finish_reason: str | None
    position: int | None  # output token index of the stop token (0-based)
    stop_token: str | None
    runner_up: str | None
    margin: float | None  # logprob(stop token) - logprob(runner-up), in logits
    threshold: float
    explanation: str
    request: str = ""

    @property
    def unread(self) -> bool:
        """A stop whose last token is not the model's end-of-text: its margin could not be read."""
        return self.finish_reason == "stop" and self.stop_token is not None and self.margin is None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EndOfText:
    """A model's end-of-text tokens, as they can appear in logprobs: vLLM writes a token as its decoded text
    (`tokenizer.decode([id])`: "<|im_end|>"), `RequestOutput`s here as "text#id", and a server run with
    `--return-tokens-as-token-ids` as "token_id:id"."""
    ids: frozenset[int]
    texts: frozenset[str]

    def matches(self, token: str, stop_reason=None) -> bool:
        """Is `token` the one that ended generation: an end-of-text token, or the stop token id the caller gave
        (vLLM's `stop_reason`)?"""
        stop_ids = self.ids | ({stop_reason} if isinstance(stop_reason, int) else set())
        numbered = re.fullmatch(r"(?:.*#|token_id:)(\d+)", token, re.DOTALL)
        return int(numbered[1]) in stop_ids if numbered else token in self.texts or isinstance(stop_reason, int)

    def names(self) -> str:
        return ", ".join(sorted(self.texts)) + f" (ids {', '.join(map(str, sorted(self.ids)))})"


def end_of_text(model_path: str) -> EndOfText:
    """The end-of-text tokens of a model folder (or hub id): its generation config's EOS ids, else its
    tokenizer's, with the texts vLLM decodes them to."""
    special = special_end_of_text(Path(model_path))
    if special:
        return special
    from spectie.lab.tokenizer import end_of_text_ids, model_tokenizer

    tokenizer = model_tokenizer(model_path)
    ids = end_of_text_ids(model_path, tokenizer)
    texts = {tokenizer.decode([i]) for i in ids} | set(tokenizer.convert_ids_to_tokens(ids))
    return EndOfText(frozenset(ids), frozenset(texts))


def special_end_of_text(folder: Path) -> EndOfText | None:
    """`end_of_text` of a model folder whose generation config names special tokens (Qwen3.5's do), read from its
    JSON files: a special token decodes to its own text, so the tokenizer (seconds to load for a 248k vocabulary)
    is not needed. None where the folder does not say it that way."""
    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
        at = text.index("[", text.index('"added_tokens"'))
        added, _ = json.JSONDecoder().raw_decode(text, at)  # the list alone, not the whole vocabulary
        special = {token["id"]: token["content"] for token in added if token.get("special")}
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None
    ids = [eos] if isinstance(eos, int) else eos
    if not ids or not isinstance(ids, list) or not all(isinstance(i, int) and i in special for i in ids):
        return None
    return EndOfText(frozenset(ids), frozenset(special[i] for i in ids))


def runner_up(step: Step) -> tuple[str | None, float]:
    """The best token offered other than the chosen one, and the chosen token's margin over it in logits
    (None and NaN when the logprobs hold only the chosen token)."""
    others = {token: lp for token, lp in step.top.items() if token != step.token}
    if not others:
        return None, float("nan")
    token, logprob = max(others.items(), key=lambda item: item[1])
    return token, step.logprob - logprob


def is_near_tie(margin: float, threshold: float) -> bool:
    """The one rule of a near-tie: two tokens at most `threshold` logits apart, in either order. The detector's, on a
    stop token and its runner-up (a stop token below the runner-up was not chosen by greedy decoding, but a near-tie
    is one either way); the classifier's, on two diverging tokens in fp32; and every page's that says either.
    At most, not less than: served margins are differences of bf16 logits, so a margin of exactly one bf16 step
    (`thresholds.bf16_step`) is the closest two different logits can be."""
    return abs(margin) <= threshold


def check(completion: Completion, threshold: float, stops: EndOfText | None = None) -> Verdict:
    """Flag a stop that won by less than `threshold` logits; a completion that did not stop is not flagged.
    With the model's end-of-text tokens (`stops`), a last token that is none of them is reported as a stop
    whose margin cannot be read (margin None), not measured as if it were the stop token."""
    if threshold < 0 or math.isnan(threshold):
        raise UsageError(f"the threshold must be a margin in logits >= 0, got {threshold!r}")
    common = {"finish_reason": completion.finish_reason, "threshold": threshold, "request": completion.request}
    if completion.finish_reason != "stop":
        return Verdict(False, position=None, stop_token=None, runner_up=None, margin=None,
                       explanation=f"finish_reason {completion.finish_reason!r}: no stop to check", **common)
    if isinstance(completion.stop_reason, str):  # the text matched a stop string: no token chose to end here
        return Verdict(False, position=None, stop_token=None, runner_up=None, margin=None,
                       explanation=f"stopped by the stop string {completion.stop_reason!r} the caller gave, not by a "
                                   "token the model chose to end with: not a tie question", **common)
    if not completion.steps:
        raise UsageError(f"{completion.source} {completion.request}: the completion has no logprobs; {HOW_TO_REQUEST}")
    last = completion.steps[-1]
    if stops is not None and not stops.matches(last.token, completion.stop_reason):
        return Verdict(False, position=len(completion.steps) - 1, stop_token=last.token, runner_up=None, margin=None,
                       explanation=f"the last token with logprobs, {last.token!r}, is not an end-of-text token of the "
                                   f"model ({stops.names()}): the logprobs do not reach the token that stopped "
                                   "generation, so its margin cannot be read", **common)
    other, margin = runner_up(last)
    if other is None:
        raise UsageError(f"{completion.source} {completion.request}: the logprobs hold only the chosen token at the "
                         f"stop (top-1); the margin needs the runner-up: {HOW_TO_REQUEST}")
    flagged = is_near_tie(margin, threshold)
    if margin < 0:  # greedy argmax cannot choose a token below another: something else chose the stop
        explanation = (f"the stop token {last.token!r} is {-margin:.3f} logits below {other!r} in the logprobs: "
                       "sampling, a logit bias or penalty, or a bug forcing the stop (the premature end-of-text of "
                       "vLLM #41467) chose it, not greedy decoding; "
                       + ("within the noise band, a near-tie either way" if flagged else
                          "outside the noise band, not a tie: compare with plain greedy (spectie classify)"))
    else:
        explanation = (f"the stop token {last.token!r} won by {margin:.3f} logits over {other!r}: "
                       + ("inside the noise band, a near-tie another computation shape could flip" if flagged
                          else "outside the noise band"))
    return Verdict(flagged, position=len(completion.steps) - 1, stop_token=last.token, runner_up=other,
                   margin=margin, explanation=explanation, **common)


def from_request_output(output) -> list[Completion]:
    """The completions of one vLLM `RequestOutput` (one per `n`)."""
    completions = []
    for choice in output.outputs:
        steps = []
        for token_id, position in zip(choice.token_ids, choice.logprobs or []):
            chosen = position[token_id]
            top = {_vllm_token(tid, lp): lp.logprob for tid, lp in position.items()}
            steps.append(Step(_vllm_token(token_id, chosen), chosen.logprob, top))
        completions.append(Completion(steps, choice.finish_reason, "vllm RequestOutput",
                                      f"{output.request_id}/{choice.index}", getattr(choice, "stop_reason", None)))
    return completions


def _vllm_token(token_id: int, logprob) -> str:
    """A token as vLLM decoded it, with its id (special tokens may decode to an empty string)."""
    return f"{logprob.decoded_token!s}#{token_id}" if logprob.decoded_token is not None else f"#{token_id}"


def _number(value, where: str) -> float:
    """A logprob as given: a JSON number (not a boolean, not text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{where}: expected a number, got {_shown(value)}")
    return float(value)


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{where}: expected a token (text), got {_shown(value)}")
    return value


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected an object, got {_shown(value)}")
    return value


def _listing(value, where: str) -> list:
    if not isinstance(value, list):
        raise UsageError(f"{where}: expected a list, got {_shown(value)}")
    return value


def _shown(value) -> str:
    """A value as a message quotes it: its JSON type and the start of its text."""
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:40]}{'…' if len(text) > 40 else ''}"


def _chat_steps(content: list, where: str) -> list[Step]:
    steps = []
    for i, entry in enumerate(_listing(content, f"{where}.content")):
        at = f"{where}.content[{i}]"
        entry = _mapping(entry, at)
        top = {}
        for j, alt in enumerate(_listing(entry.get("top_logprobs") or [], f"{at}.top_logprobs")):
            alt = _mapping(alt, f"{at}.top_logprobs[{j}]")
            top[_text(alt.get("token"), f"{at}.top_logprobs[{j}].token")] = \
                _number(alt.get("logprob"), f"{at}.top_logprobs[{j}].logprob")
        steps.append(Step(_text(entry.get("token"), f"{at}.token"), _number(entry.get("logprob"), f"{at}.logprob"), top))
    return steps


def _completion_steps(logprobs: dict, where: str) -> list[Step]:
    for key in ("tokens", "token_logprobs"):
        if key not in logprobs:
            raise UsageError(f"{where}: completion logprobs without '{key}'")
    tokens = _listing(logprobs["tokens"], f"{where}.tokens")
    values = _listing(logprobs["token_logprobs"], f"{where}.token_logprobs")
    tops = _listing(logprobs.get("top_logprobs") or [], f"{where}.top_logprobs")
    if len(values) != len(tokens) or (tops and len(tops) != len(tokens)):
        raise UsageError(f"{where}: {len(tokens)} tokens but {len(values)} token_logprobs and {len(tops)} top_logprobs")
    steps = []
    for i, token in enumerate(tokens):
        top = _mapping(tops[i] if tops and tops[i] is not None else {}, f"{where}.top_logprobs[{i}]")
        steps.append(Step(_text(token, f"{where}.tokens[{i}]"), _number(values[i], f"{where}.token_logprobs[{i}]"),
                          {_text(k, f"{where}.top_logprobs[{i}] key"): _number(v, f"{where}.top_logprobs[{i}][{k!r}]")
                           for k, v in top.items()}))
    return steps


def from_openai(response: dict, request: str = "") -> list[Completion]:
    """The choices of an OpenAI-compatible completion or chat completion response (a parsed JSON object).
    Anything else (a missing field, a field of the wrong type) is bad input: a UsageError naming where."""
    where = f"response {request}".strip()
    if not isinstance(response, dict) or "choices" not in response:
        raise UsageError(f"{where}: not an OpenAI-compatible response (an object with 'choices')")
    completions = []
    for index, choice in enumerate(_listing(response["choices"], f"{where}: choices")):
        at = f"{where}: choices[{index}]"
        choice = _mapping(choice, at)
        name = f"{request or response.get('id', '')}/{choice.get('index', index)}"
        logprobs = choice.get("logprobs")
        if logprobs is None:
            steps = []
        elif "content" in _mapping(logprobs, f"{at}.logprobs"):  # chat completion
            steps = _chat_steps(logprobs["content"] or [], f"{at}.logprobs")
        else:  # completion
            steps = _completion_steps(logprobs, f"{at}.logprobs")
        finish = choice.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise UsageError(f"{at}.finish_reason: expected text or null, got {_shown(finish)}")
        source = "openai chat completion" if "message" in choice else "openai completion"
        completions.append(Completion(steps, finish, source, name, choice.get("stop_reason")))
    return completions


def read_jsonl(path: str | Path) -> list[Completion]:
    """Every completion of a JSONL file of OpenAI-compatible responses (one JSON object per line). A file that
    holds none is bad input, not a pass: an empty or truncated log must not pass a gate."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    completions = []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                response = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise UsageError(f"{path}:{number}: not JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
            completions += from_openai(response, f"{path.name}:{number}")
    if not completions:
        raise UsageError(f"{path}: no completions in it (an empty or truncated log is not a pass)")
    return completions


def _token_ids(value, where: str) -> list[int]:
    ids = _listing(value, where)
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise UsageError(f"{where}[{i}]: expected a token id (an integer >= 0), got {_shown(token)}")
    return ids


def from_record(record) -> list[Completion]:
    """The completions of a reproduction record (`make run CHAPTER=reproduce`), one per repeat, as the detector
    reads them: the top-2 margin vLLM served at each output position, the stop token and its runner-up named."""
    if record.kind != "engine-outcome" or record.results.repeats is None:
        raise UsageError(f"record {record.id!r}: not a reproduction record (kind engine-outcome, with repeats)")
    completions = []
    for number, repeat in enumerate(_listing(record.results.repeats, f"record {record.id!r}: results.repeats"), 1):
        where = f"record {record.id!r}: results.repeats[{number - 1}]"
        repeat = _mapping(repeat, where)
        ids = _token_ids(repeat.get("token_ids"), f"{where}.token_ids")
        margins = _listing(repeat.get("top2_margins") or [], f"{where}.top2_margins")
        margins = [None if m is None else _number(m, f"{where}.top2_margins[{i}]") for i, m in enumerate(margins)]
        steps = [Step(f"#{token}", 0.0, {f"#{token}": 0.0} if margin is None else {f"#{token}": 0.0, "runner-up": -margin})
                 for token, margin in zip(ids, margins)]
        stop = repeat.get("stop_margin")
        if stop and steps:
            stop = _mapping(stop, f"{where}.stop_margin")
            token = _text(stop.get("stop_token"), f"{where}.stop_margin.stop_token")
            other = _text(stop.get("runner_up"), f"{where}.stop_margin.runner_up")
            steps[-1] = Step(token, 0.0, {token: 0.0, other: -_number(stop.get("margin"), f"{where}.stop_margin.margin")})
        finish = repeat.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise UsageError(f"{where}.finish_reason: expected text or null, got {_shown(finish)}")
        completions.append(Completion(steps, finish, "reproduction record", f"{record.id} repeat {number}",
                                      repeat.get("stop_reason")))
    if not completions:
        raise UsageError(f"record {record.id!r}: no repeats to check (status "
                         f"{record.results.status!r}: the configuration wrote nothing)")
    return completions


