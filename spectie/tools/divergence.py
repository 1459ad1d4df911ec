"""Divergence classifier: is the first difference between two greedy outputs a near-tie or a bug?

Given a prompt and two token sequences generated from it (say speculative and plain greedy), find the
first output position where they differ and recompute, in fp32 through transformers' torch reference
code (TF32 off), the logits at that position from the context both sequences share. If the fp32 margin
between the two tokens lies inside the noise band, either token is what some correct computation order
would pick: a **numerical near-tie**. Outside the band, one of the two engines picked a token that a
correct computation would not: a **suspected correctness bug** (for example a recurrent state read from
the wrong slot, the class of bug of vLLM #39273).

One output that is a strict prefix of the other is the silent early stop itself: one run ended where the
other went on. That is a divergence at the shorter output's end, stop against continue: the shorter one
is taken to have written the model's end-of-text there (vLLM returns the EOS id with the tokens; a caller
whose shorter output lost its EOS gets the same reading), and the margin is end-of-text's against the
other run's token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.records.record_types import Record, Verdict
from spectie.tools.tiestop import is_near_tie


@dataclass(frozen=True)
class Divergence:
    verdict: Verdict
    position: int | None  # output token index of the first difference
    token_a: int | None
    token_b: int | None
    text_a: str | None
    text_b: str | None
    reference_margin: float | None  # fp32 logit(token_a) - logit(token_b), from the shared context
    serving_margin: float | None  # the same in the serving precision
    reference_top1: str | None  # fp32's own choice there (text), and the two tokens' fp32 ranks
    rank_a: int | None
    rank_b: int | None
    outside_band_a: list  # positions where a's token trails fp32's top-1, from a's own context, by more than the band
    outside_band_b: list
    threshold: float
    threshold_origin: str
    explanation: str
    stopped: str | None = None  # "a" or "b": the sequence that ended (end-of-text) where the other went on
    stop_position: int | None = None  # the output token of that end-of-text (the divergence's, or a later one)


    def as_dict(self) -> dict:
        return asdict(self)


def check_tokens(name: str, ids, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UsageError(f"{name} must be a list of token ids (integers)")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise UsageError(f"{name}: token id(s) {outside[:5]} are outside the model's vocabulary (0..{vocab_size - 1}); "
                         "were they produced by another tokenizer?")
    return ids


def gaps(logits, tokens: list[int]) -> list[float]:
    """How far each chosen token trails its row's top-1, in logits (0: it is the top-1)."""
    return [float(gap) for gap in logits.max(dim=1).values - logits[range(len(tokens)), tokens]]


def trailing(gap_list: list[float], tokens: list[int], threshold: float, decode) -> list[dict]:
    """Positions where the chosen token trails the row's top-1 by more than `threshold` logits (first 10)."""
    return [{"position": i, "token": decode(tokens[i]), "gap": round(gap, 4)}
            for i, gap in enumerate(gap_list) if gap > threshold][:10]


SCORES_DIR = "artifacts/cache/divergence-scores"  # beside the unpacked organism: made on this host, never committed


def _scores_file(path: str, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int], device: str,
                 serving_dtype: str) -> Path | None:
    """Where the scores of this pair are kept: keyed by the weights' digest, the tokens, the device, the serving
    precision, the torch and transformers versions and this scoring code; None for weights without a digest."""
    import hashlib

    from spectie.records.fingerprint import measurement_key, model_digest
    from spectie.records.paths import project_root

    if model_digest(path) is None:
        return None
    key = measurement_key("divergence-scores", path, [prompt_ids, tokens_a, tokens_b, device, serving_dtype],
                          ("spectie/tools/divergence.py", "spectie/lab/model.py", "spectie/lab/tokenizer.py"))
    return project_root() / SCORES_DIR / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def scores(path: str, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int], index: int,
           device: str = "cpu", serving_dtype: str = "bfloat16") -> dict:
    """The figures of one divergence that need the model, whatever the band: the fp32 margin of the two tokens at
    `index` from their shared context, the same in the serving precision, fp32's top-1 there and the two tokens'
    ranks, and how far each token of both sequences trails fp32's top-1 from its own context. Computed once on a
    host (kept in SCORES_DIR): the chapter, the tests and the command line read the same scores."""
    from spectie.records.store import write_text_atomic

    kept = _scores_file(path, prompt_ids, tokens_a, tokens_b, device, serving_dtype)
    if kept is not None and kept.is_file():
        return json.loads(kept.read_text())
    scoring = scorer(path, device, serving_dtype)
    rows_a = scoring.logits("float32", prompt_ids, tokens_a)
    rows_b = scoring.logits("float32", prompt_ids, tokens_b)
    served = scoring.logits(serving_dtype, prompt_ids, tokens_a[:index + 1], rows=[index])[0]
    a, b = tokens_a[index], tokens_b[index]
    row = rows_a[index]  # the shared context: both sequences agree up to `index`
    order = row.argsort(descending=True).tolist()
    result = {"margin": float(row[a] - row[b]), "served_margin": float(served[a] - served[b]), "top1": order[0],
              "rank_a": order.index(a) + 1, "rank_b": order.index(b) + 1,
              "gaps_a": gaps(rows_a, tokens_a), "gaps_b": gaps(rows_b, tokens_b)}
    if kept is not None:
        write_text_atomic(kept, json.dumps(result))
    return result


def stop_where_other_goes_on(tokens_a: list[int], tokens_b: list[int], eos_ids: list[int]):
    """("a" or "b", output token) of the sequence that writes end-of-text where the other writes another token,
    or (None, None)."""
    for name, tokens, other in (("a", tokens_a, tokens_b), ("b", tokens_b, tokens_a)):
        at = next((i for i, token in enumerate(tokens) if token in eos_ids), None)
        if at is not None and len(other) > at and other[at] not in eos_ids:
            return name, at
    return None, None


class Scorer:
    """Teacher-forced logits of one checkpoint, in fp32 through transformers' torch reference code (the reference)
    and in the serving precision: each model loaded once, and each prompt's state (KV cache, GDN and convolution
    states) computed once and shared by every sequence scored after it. The prompts' forward passes are most of a
    classification's cost (1,845 prompt tokens against at most 48 output tokens in the labelled cases)."""

    PROMPTS_KEPT = 8  # prompt states kept per precision (the labelled cases use 8 prompts)

    def __init__(self, path: str, device: str = "cpu", serving_dtype: str = "bfloat16"):
        self.path, self.device, self.serving_dtype = path, device, serving_dtype
        self._models: dict[str, object] = {}
        self._prompts: dict[tuple, tuple] = {}

    def _model(self, dtype: str):
        from spectie.lab.model import load_model

        if dtype not in self._models:
            self._models[dtype] = load_model(self.path, dtype, self.device)
        return self._models[dtype]

    def logits(self, dtype: str, prompt_ids: list[int], tokens: list[int], rows: list[int] | None = None):
        """Logits (float64, on CPU), row i predicting tokens[i] after the prompt and tokens[:i]: the prompt's
        state (computed once), then one forward over the tokens from a copy of it. `rows`: only those rows (the
        output head over a 248k vocabulary is most of the cost of a short sequence, in bf16 on a CPU above all)."""
        import copy

        import torch

        from spectie.lab.model import reference_gdn_kernels

        model = self._model(dtype)
        key = (dtype, tuple(prompt_ids))
        with torch.no_grad(), reference_gdn_kernels():
            if key not in self._prompts:
                out = model.model(input_ids=torch.tensor([list(prompt_ids)], device=self.device), use_cache=True)
                mine = [k for k in self._prompts if k[0] == dtype]
                for old in mine[:max(0, len(mine) - self.PROMPTS_KEPT + 1)]:
                    del self._prompts[old]
                self._prompts[key] = (out.past_key_values, out.last_hidden_state[0, -1:])
            cache, hidden = self._prompts[key]
            if len(tokens) > 1:
                more = model.model(input_ids=torch.tensor([list(tokens[:-1])], device=self.device),
                                   past_key_values=copy.deepcopy(cache), use_cache=True).last_hidden_state[0]
                hidden = torch.cat([hidden, more])
            if rows is not None:
                hidden = hidden[torch.tensor(rows, device=hidden.device)]
            return model.lm_head(hidden).double().cpu()


_SCORERS: dict[tuple, Scorer] = {}


def scorer(path: str, device: str = "cpu", serving_dtype: str = "bfloat16") -> Scorer:
    """The process's scorer of this checkpoint (one per path, device and serving precision: the models and the
    prompt states are reused by every classification in the process)."""
    key = (str(path), device, serving_dtype)
    if key not in _SCORERS:
        _SCORERS.clear()  # one checkpoint's models in memory at a time
        _SCORERS[key] = Scorer(str(path), device, serving_dtype)
    return _SCORERS[key]


def checked_model(model: str, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int],
                  threshold: float | None, device: str, serving_dtype: str) -> str:
    """The model's folder, once the device, the precision, the three token lists (ids within its vocabulary, none
    empty) and the threshold are checked (UsageError)."""
    from transformers import AutoConfig

    from spectie.lab.model import check_device, resolve_model, torch_dtype

    check_device(device)
    torch_dtype(serving_dtype)
    path = resolve_model(model)
    config = AutoConfig.from_pretrained(path)
    vocab = getattr(config, "text_config", config).vocab_size
    for name, ids in (("prompt_ids", prompt_ids), ("tokens_a", tokens_a), ("tokens_b", tokens_b)):
        check_tokens(name, ids, vocab)
    if not prompt_ids or not tokens_a or not tokens_b:
        raise UsageError("the prompt and both sequences need at least one token")
    if threshold is not None and not threshold >= 0:
        raise UsageError(f"the threshold must be a margin in logits >= 0, got {threshold!r}")
    return path


def judge(index: int, text_a: str, text_b: str, margin: float, threshold: float, outside_a: list[dict],
          outside_b: list[dict], stopped: str | None, stop_position: int | None) -> tuple[str, str]:
    """The verdict on a first divergence at output token `index` and its explanation: a suspected bug when fp32 puts
    the two tokens further apart than the band, or when a later token of either sequence trails fp32's own choice
    by more than the band (`outside_a`, `outside_b`); else a near-tie."""
    # The explanation counts output tokens from 1, as the book's tables do; `position` fields stay 0-based.
    head = f"at output token {index + 1}, {text_a!r} and {text_b!r} are {abs(margin):.3f} logits apart in fp32"
    if stop_position == index:
        head = (f"sequence {stopped} stops at output token {index + 1} where the other goes on (end-of-text against "
                f"{text_b if stopped == 'a' else text_a!r}, stop against continue); {head}")
    if not is_near_tie(margin, threshold):
        verdict = Verdict.BUG
        explanation = (f"{head} (outside the {threshold:.3f} noise band): a correct computation would not pick "
                       f"{text_a if margin < 0 else text_b!r} there; look for a bug")
    elif outside_a or outside_b:
        verdict = Verdict.BUG
        name, where = ("a", outside_a) if outside_a else ("b", outside_b)
        explanation = (f"{head} (a near-tie), but sequence {name} later picks, from its own context, tokens that "
                       f"the fp32 reference ranks more than the {threshold:.3f} noise band below its top-1 (first at "
                       f"output token {where[0]['position'] + 1}, {where[0]['gap']:.3f} logits): look for a bug")
    else:
        verdict = Verdict.NEAR_TIE
        explanation = (f"{head} (within the {threshold:.3f} noise band), and every token of both sequences is within "
                       "the band of fp32's own choice: either is what some correct computation order picks")
    if stop_position is not None and stop_position != index:
        explanation += (f"; sequence {stopped} later stops (end-of-text at output token {stop_position + 1}) where the other "
                        "goes on: that stop follows from this first divergence, not from a tie of its own")
    return verdict, explanation


def classify(model: str, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int],
             threshold: float | None = None, device: str = "cpu", serving_dtype: str = "bfloat16") -> Divergence:
    """Classify the first divergence of `tokens_a` from `tokens_b` (outputs generated after `prompt_ids`).

    Also checks every token of both sequences against the fp32 reference from its own context: a correct
    engine, whatever its computation order, picks a token within the noise band of the reference's top-1.
    `threshold`: the noise band in logits; default the recorded bf16 band of the nearest model size."""
    from spectie.records.completions import first_divergence
    from spectie.lab.tokenizer import end_of_text_ids
    from spectie.tools.thresholds import threshold_for_model
    from spectie.lab.tokenizer import model_tokenizer

    path = checked_model(model, prompt_ids, tokens_a, tokens_b, threshold, device, serving_dtype)
    index = first_divergence(tokens_a, tokens_b)
    if index is None:
        return Divergence(Verdict.IDENTICAL, None, None, None, None, None, None, None, None, None, None, [], [],
                          threshold if threshold is not None else float("nan"), "given" if threshold is not None else "",
                          "no divergence: the two sequences are identical")
    eos_ids = end_of_text_ids(path)
    if index == len(tokens_a) < len(tokens_b):  # a strict prefix: the shorter one lost its end-of-text
        tokens_a = tokens_a + eos_ids[:1]
    elif index == len(tokens_b) < len(tokens_a):
        tokens_b = tokens_b + eos_ids[:1]
    stopped, stop_position = stop_where_other_goes_on(tokens_a, tokens_b, eos_ids)
    tokenizer = model_tokenizer(path)
    decode = lambda token: tokenizer.decode([token])  # noqa: E731
    a, b = tokens_a[index], tokens_b[index]
    origin = "given"
    if threshold is None:
        threshold, origin = threshold_for_model(path)
    found = scores(path, prompt_ids, tokens_a, tokens_b, index, device, serving_dtype)
    margin = found["margin"]
    outside_a = trailing(found["gaps_a"], tokens_a, threshold, decode)
    outside_b = trailing(found["gaps_b"], tokens_b, threshold, decode)
    text_a, text_b = decode(a), decode(b)
    verdict, explanation = judge(index, text_a, text_b, margin, threshold, outside_a, outside_b, stopped,
                                 stop_position)
    return Divergence(verdict, index, a, b, text_a, text_b, margin, found["served_margin"], decode(found["top1"]),
                      found["rank_a"], found["rank_b"], outside_a, outside_b, threshold, origin, explanation,
                      stopped, stop_position)


def read_pair(path: str | Path) -> dict:
    """A JSON file with `prompt_token_ids`, `a` and `b` (token id lists) and optionally `model`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object with prompt_token_ids, a, b")
    for name in ("a", "b"):
        if isinstance(data.get(name), dict):  # an OpenAI-compatible response of vllm serve
            prompt, data[name] = openai_token_ids(data[name], f"{path}: {name}")
            data.setdefault("prompt_token_ids", prompt)
            if prompt is not None and data["prompt_token_ids"] != prompt:
                raise UsageError(f"{path}: a and b were generated from different prompts")
    missing = [k for k in ("prompt_token_ids", "a", "b") if data.get(k) is None]
    if missing:
        raise UsageError(f"{path}: missing {', '.join(missing)} (expected prompt_token_ids, a, b: lists of token ids, "
                         "or a and b as responses of vllm serve requested with \"return_token_ids\": true)")
    for key in ("prompt_token_ids", "a", "b"):
        check_token_list(data[key], f"{path}: {key}")
    if data.get("model") is not None and not isinstance(data["model"], str):
        raise UsageError(f"{path}: model must be a name or a folder (text), got {type(data['model']).__name__}")
    return data


def check_token_list(ids, where: str) -> list[int]:
    """A list of token ids as given (before any model is read): integers >= 0, at least one."""
    if not isinstance(ids, list) or not ids:
        raise UsageError(f"{where}: expected a non-empty list of token ids")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise UsageError(f"{where}: expected token ids (integers >= 0), found {json.dumps(bad[0])[:40]}")
    return ids


def openai_token_ids(response: dict, name: str) -> tuple[list[int] | None, list[int]]:
    """The prompt's and the output's token ids of a one-choice OpenAI-compatible response of vllm serve (completion or
    chat completion) requested with `"return_token_ids": true`. Without them the classifier refuses: text cannot say
    at which token two outputs part (it may re-tokenize into other ids), nor whether a stop wrote end-of-text."""
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise UsageError(f"{name}: expected an OpenAI-compatible response with one choice")
    [choice] = choices
    if not isinstance(choice, dict):
        raise UsageError(f"{name}: its choice is not an object")
    ids = choice.get("token_ids")
    if ids is None:
        raise UsageError(f"{name}: the response carries text but no token ids, so the token where the two outputs "
                         "part, its margin, and whether a stop wrote end-of-text cannot be decided (re-tokenized text "
                         "need not give the ids the engine wrote); request them from vllm serve with "
                         "\"return_token_ids\": true")
    return choice.get("prompt_token_ids") or response.get("prompt_token_ids"), ids




def pair_from_records(record: Record, baseline: Record, repeat: int = 0) -> dict:
    """The classifier's input from two reproduction records (`engine-outcome`) of one matrix run: the
    prompt, one repeat of `record` as a, the same repeat of its baseline as b."""
    for r in (record, baseline):
        if r.kind != "engine-outcome" or r.parameters.prompt_token_ids is None \
                or not isinstance(r.results.repeats, list):
            raise UsageError(f"record {r.id!r} is not a reproduction record with its prompt and repeats "
                             "(records from before prompts were recorded cannot be classified)")
        if not 0 <= repeat < len(r.results.repeats):
            raise UsageError(f"record {r.id!r} has no repeat {repeat} (status {r.results.status!r})")
        check_token_list(r.parameters.prompt_token_ids, f"record {r.id!r}: parameters.prompt_token_ids")
        chosen = r.results.repeats[repeat]
        check_token_list(chosen.get("token_ids") if isinstance(chosen, dict) else None,
                         f"record {r.id!r}: results.repeats[{repeat}].token_ids")
    if record.parameters.prompt_token_ids != baseline.parameters.prompt_token_ids:
        raise UsageError(f"records {record.id!r} and {baseline.id!r} were run on different prompts")
    return {"prompt_token_ids": record.parameters.prompt_token_ids, "model": record.parameters.model,
            "a": record.results.repeats[repeat]["token_ids"], "b": baseline.results.repeats[repeat]["token_ids"],
            "a_name": record.parameters.configuration, "b_name": baseline.parameters.configuration}


def baseline_record(record_path: str | Path) -> Record:
    """The baseline record beside a reproduction record (same folder, the configuration its record names,
    the same run: matrix, model, prompt seed and set, tensor-parallel split)."""
    from spectie.records.store import read_record

    record_path = Path(record_path)
    record = read_record(record_path)
    name = getattr(record.parameters, "baseline", None)
    if not isinstance(name, str):
        raise UsageError(f"{record_path}: names no baseline configuration (parameters.baseline)")
    for path in sorted(record_path.parent.glob("*.json")):
        other = read_record(path)
        same_run = other.kind == "engine-outcome" and all(
            getattr(other.parameters, key) == getattr(record.parameters, key, None)
            for key in ("matrix", "model", "prompt_seed", "prompt_seeds", "tensor_parallel_size"))
        if same_run and other.parameters.configuration == name:
            return other
    raise UsageError(f"no record of the baseline configuration {name!r} beside {record_path}")


def matrix_verdicts(records: list[Record], threshold: float | None = None) -> dict[str, str]:
    """The classifier's verdict on each configuration whose first repeat parts from plain greedy's (same prompt, the
    records' own model): its id -> "near-tie" or "suspected bug" (fp32 reference)."""
    base = next((r for r in records if r.is_baseline and r.results.repeats), None)
    verdicts = {}
    for r in records:
        repeats = r.results.repeats
        if base is None or r is base or not repeats or repeats[0].get("first_divergence") is None:
            continue
        pair = pair_from_records(r, base)
        result = classify(r.parameters.model, pair["prompt_token_ids"], pair["a"], pair["b"], threshold)
        verdicts[r.parameters.configuration] = result.verdict.short
    return verdicts
