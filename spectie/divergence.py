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

from spectie.errors import UsageError

NEAR_TIE = "numerical near-tie"
SUSPECTED_BUG = "suspected correctness bug"
IDENTICAL = "identical"


@dataclass(frozen=True)
class Divergence:
    verdict: str  # NEAR_TIE, SUSPECTED_BUG or IDENTICAL
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

    from spectie.fingerprint import measurement_key, model_digest
    from spectie.paths import project_root

    if model_digest(path) is None:
        return None
    key = measurement_key("divergence-scores", path, [prompt_ids, tokens_a, tokens_b, device, serving_dtype],
                          ("spectie/divergence.py", "spectie/model.py"))
    return project_root() / SCORES_DIR / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def scores(path: str, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int], index: int,
           device: str = "cpu", serving_dtype: str = "bfloat16") -> dict:
    """The figures of one divergence that need the model, whatever the band: the fp32 margin of the two tokens at
    `index` from their shared context, the same in the serving precision, fp32's top-1 there and the two tokens'
    ranks, and how far each token of both sequences trails fp32's top-1 from its own context. Computed once on a
    host (kept in SCORES_DIR): the chapter, the tests and the command line read the same scores."""
    from spectie.records import write_text_atomic

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
        from spectie.model import load_model

        if dtype not in self._models:
            self._models[dtype] = load_model(self.path, dtype, self.device)
        return self._models[dtype]

    def logits(self, dtype: str, prompt_ids: list[int], tokens: list[int], rows: list[int] | None = None):
        """Logits (float64, on CPU), row i predicting tokens[i] after the prompt and tokens[:i]: the prompt's
        state (computed once), then one forward over the tokens from a copy of it. `rows`: only those rows (the
        output head over a 248k vocabulary is most of the cost of a short sequence, in bf16 on a CPU above all)."""
        import copy

        import torch

        from spectie.model import reference_gdn_kernels

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


def classify(model: str, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int],
             threshold: float | None = None, device: str = "cpu", serving_dtype: str = "bfloat16") -> Divergence:
    """Classify the first divergence of `tokens_a` from `tokens_b` (outputs generated after `prompt_ids`).

    Also checks every token of both sequences against the fp32 reference from its own context: a correct
    engine, whatever its computation order, picks a token within the noise band of the reference's top-1.
    `threshold`: the noise band in logits; default the recorded bf16 band of the nearest model size."""
    from transformers import AutoConfig

    from spectie.model import check_device, end_of_text_ids, resolve_model, torch_dtype
    from spectie.engines.runner import first_divergence
    from spectie.tiestop import threshold_for_model
    from spectie.tokenizer import model_tokenizer

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
    index = first_divergence(tokens_a, tokens_b)
    if index is None:
        return Divergence(IDENTICAL, None, None, None, None, None, None, None, None, None, None, [], [],
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
    # The explanation counts output tokens from 1, as the book's tables do; `position` fields stay 0-based.
    head = f"at output token {index + 1}, {text_a!r} and {text_b!r} are {abs(margin):.3f} logits apart in fp32"
    if stop_position == index:
        head = (f"sequence {stopped} stops at output token {index + 1} where the other goes on (end-of-text against "
                f"{text_b if stopped == 'a' else text_a!r}, stop against continue); {head}")
    if abs(margin) > threshold:
        verdict = SUSPECTED_BUG
        explanation = (f"{head} (outside the {threshold:.3f} noise band): a correct computation would not pick "
                       f"{text_a if margin < 0 else text_b!r} there; look for a bug")
    elif outside_a or outside_b:
        verdict = SUSPECTED_BUG
        name, where = ("a", outside_a) if outside_a else ("b", outside_b)
        explanation = (f"{head} (a near-tie), but sequence {name} later picks, from its own context, tokens that "
                       f"the fp32 reference ranks more than the {threshold:.3f} noise band below its top-1 (first at "
                       f"output token {where[0]['position'] + 1}, {where[0]['gap']:.3f} logits): look for a bug")
    else:
        verdict = NEAR_TIE
        explanation = (f"{head} (within the {threshold:.3f} noise band), and every token of both sequences is within "
                       "the band of fp32's own choice: either is what some correct computation order picks")
    if stop_position is not None and stop_position != index:
        explanation += (f"; sequence {stopped} later stops (end-of-text at output token {stop_position + 1}) where the other "
                        "goes on: that stop follows from this first divergence, not from a tie of its own")
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


# Planted bugs, one per public class an operator must tell from a near-tie (greedy_with_bug):
BUGS = {
    "lost-state": "every GDN layer reads its recurrent state from an empty slot (zeros): the state read from "
                  "the wrong slot of vLLM #39273",
    "stale-state": "every GDN layer reads the recurrent state saved at the end of the prompt (block 0) instead "
                   "of its last one: a state read from an earlier block (#39273's fixes)",
    "conv-offset": "once, every GDN layer's convolution state is read one token off (rolled by one position)",
    "gate-shift": "every GDN layer's gates (decay and beta) come from the previous token: gates misaligned by "
                  "one token (#51812)",
    "forced-eos": "end-of-text is written once whatever the model computes: a stop forced at a draft position "
                  "(the premature end-of-text of #41467)",
}


def greedy_with_bug(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int], bug: str,
                    corrupt_at: int) -> list[int]:
    """Greedy decoding one token per step with a planted bug of class `bug` (BUGS) from output token
    `corrupt_at` on. Returns the output token ids."""
    import torch

    if bug not in BUGS:
        raise UsageError(f"unknown planted bug {bug!r}; valid: {', '.join(BUGS)}")
    if corrupt_at < 0:
        raise UsageError("corrupt_at is an output token index (>= 0)")
    device = next(model.parameters()).device
    gdn = [m for m in model.modules() if hasattr(m, "in_proj_a") and hasattr(m, "in_proj_b")]
    shifted = {"on": False, "last": {}}

    def previous_gate(module, args, output):  # the gate of the token before, once the bug is on
        previous = shifted["last"].get(module)
        shifted["last"][module] = output[:, -1:].detach().clone()
        return previous if shifted["on"] and previous is not None else output

    hooks = [p.register_forward_hook(previous_gate) for m in gdn for p in (m.in_proj_a, m.in_proj_b)] \
        if bug == "gate-shift" else []
    output = []
    try:
        with torch.no_grad():
            # Only the last position's logits, as generate() computes them: the output head over every prompt row
            # would cost far more than the whole decoding (Qwen3.5's vocabulary is 248k).
            out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            layers = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]  # GDN layers
            saved = [layer.recurrent_states[0].clone() for layer in layers]  # the state at the prompt's end
            for step in range(max_new_tokens):
                token = int(out.logits[0, -1].argmax())
                if bug == "forced-eos" and step == corrupt_at:
                    token = eos_ids[0]
                output.append(token)
                if token in eos_ids:
                    break
                if bug == "lost-state" and step >= corrupt_at:
                    for layer in layers:
                        layer.recurrent_states[0].zero_()
                elif bug == "stale-state" and step >= corrupt_at:
                    for layer, state in zip(layers, saved):
                        layer.recurrent_states[0].copy_(state)
                elif bug == "conv-offset" and step == corrupt_at:
                    for layer in layers:
                        layer.conv_states[0].copy_(layer.conv_states[0].roll(1, dims=-1))
                shifted["on"] = step >= corrupt_at
                out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return output


def pair_from_records(record: dict, baseline: dict, repeat: int = 0) -> dict:
    """The classifier's input from two reproduction records (`engine-outcome`) of one matrix run: the
    prompt, one repeat of `record` as a, the same repeat of its baseline as b."""
    for r in (record, baseline):
        parameters, results = r.get("parameters"), r.get("results")
        if r.get("kind") != "engine-outcome" or not isinstance(parameters, dict) or "prompt_token_ids" not in parameters \
                or not isinstance(results, dict) or not isinstance(results.get("repeats"), list):
            raise UsageError(f"record {r.get('id')!r} is not a reproduction record with its prompt and repeats "
                             "(records from before prompts were recorded cannot be classified)")
        if not 0 <= repeat < len(results["repeats"]):
            raise UsageError(f"record {r['id']!r} has no repeat {repeat} (status {results.get('status')!r})")
        check_token_list(parameters["prompt_token_ids"], f"record {r['id']!r}: parameters.prompt_token_ids")
        chosen = results["repeats"][repeat]
        check_token_list(chosen.get("token_ids") if isinstance(chosen, dict) else None,
                         f"record {r['id']!r}: results.repeats[{repeat}].token_ids")
    if record["parameters"]["prompt_token_ids"] != baseline["parameters"]["prompt_token_ids"]:
        raise UsageError(f"records {record['id']!r} and {baseline['id']!r} were run on different prompts")
    return {"prompt_token_ids": record["parameters"]["prompt_token_ids"], "model": record["parameters"]["model"],
            "a": record["results"]["repeats"][repeat]["token_ids"], "b": baseline["results"]["repeats"][repeat]["token_ids"],
            "a_name": record["parameters"]["configuration"], "b_name": baseline["parameters"]["configuration"]}


def baseline_record(record_path: str | Path) -> dict:
    """The baseline record beside a reproduction record (same folder, the configuration its record names,
    the same matrix and prompt seed)."""
    from spectie.records import read_record

    record_path = Path(record_path)
    record = read_record(record_path)
    name = record["parameters"].get("baseline") if isinstance(record.get("parameters"), dict) else None
    if not isinstance(name, str):
        raise UsageError(f"{record_path}: names no baseline configuration (parameters.baseline)")
    for path in sorted(record_path.parent.glob("*.json")):
        other = read_record(path)
        same_run = all(other["parameters"].get(key, 0) == record["parameters"].get(key, 0)
                       for key in ("matrix", "prompt_seed")) if other.get("kind") == "engine-outcome" else False
        if same_run and other["parameters"].get("configuration") == name:
            return other
    raise UsageError(f"no record of the baseline configuration {name!r} beside {record_path}")


# ------------------------------------------------------------------------------ labelled cases
CASES = "sources/classifier_cases.json"  # the labelled cases, built once on the organism and kept as data
NEAR_TIE_LABEL, BUG_LABEL = "near-tie", "bug"
CASE_SEEDS = (0, 1, 2)  # planted bugs
TIE_SEEDS = tuple(range(8))  # designed ties
CORRUPT_AT = (0, 14)  # the planted bug from the first output token on, or from output token 15 on
CASE_TOKENS = 48
DIGIT_TIE = 0.05  # a digit near-tie of the labelled cases: fp32's top two tokens, both digits, at most this far apart


def digit_tie(reference, prompt_ids: list[int], output: list[int], decode) -> tuple[int, int] | None:
    """The first output position where the fp32 `reference` puts two digits on top at most DIGIT_TIE logits apart
    and `output` wrote one of them, and the other one: (position, token); None if there is none."""
    from spectie.model import teacher_forced_logits

    rows = teacher_forced_logits(reference, prompt_ids + output, [len(prompt_ids) + i for i in range(len(output))])
    for position, row in enumerate(rows):
        values, tokens = row.topk(2)
        first, second = tokens.tolist()
        if (float(values[0] - values[1]) <= DIGIT_TIE and output[position] in (first, second)
                and all(decode(t).strip().isdigit() for t in (first, second))):
            return position, second if output[position] == first else first
    return None


def build_cases(model: str = "organism", seeds=CASE_SEEDS, new_tokens: int = CASE_TOKENS, tie_seeds=TIE_SEEDS,
                log=print) -> list[dict]:
    """Labelled divergences on the organism, each a prompt and two token sequences whose truth is known by
    construction: near-ties (plain greedy against the same text taking the other side of the designed
    end-of-text/DATA tie, and against greedy decoding that takes the other side of the first digit near-tie and
    goes on, on every seed of `tie_seeds`) and planted bugs of each class in BUGS (the buggy
    decoder against plain greedy, where it changes the output, on every seed of `seeds`). Divergences of real
    engines are not labelled: nobody knows their truth (recorded_pairs gives them, unlabelled)."""
    from spectie.model import end_of_text_ids, greedy_generate, load_model, reference_gdn_kernels, resolve_model
    from spectie.prompts import PromptSpec, build_prompt
    from spectie.engines.runner import first_divergence
    from spectie.tokenizer import model_tokenizer

    path = resolve_model(model)
    tokenizer = model_tokenizer(str(path))
    eos = end_of_text_ids(path, tokenizer)
    cases = []
    with reference_gdn_kernels():
        loaded = load_model(path, "bfloat16")
        reference = load_model(path, "float32")
        for seed in sorted(set(seeds) | set(tie_seeds)):
            prompt = build_prompt(PromptSpec(tokens=1845, seed=seed), tokenizer)
            ids = list(prompt.token_ids)
            plain = greedy_generate(loaded, ids, new_tokens, eos).output_ids
            decision = prompt.decisive_output_token - 1
            other = eos[0] if plain[decision] != eos[0] else tokenizer.encode("DATA", add_special_tokens=False)[0]
            cases.append({"name": f"designed tie, seed {seed}", "label": NEAR_TIE_LABEL, "class": "designed tie",
                          "how": "plain greedy against the same text taking the other side of the designed "
                                 "end-of-text/DATA tie (stop against continue)",
                          "prompt_token_ids": ids, "a": plain[:decision] + [other], "b": plain})
            tie = digit_tie(reference, ids, plain, lambda token: tokenizer.decode([token]))
            if tie is not None:
                at, token = tie
                rest = greedy_generate(loaded, ids + plain[:at] + [token], new_tokens - at - 1, eos).output_ids \
                    if at + 1 < new_tokens and token not in eos else []
                cases.append({"name": f"digit tie, seed {seed}", "label": NEAR_TIE_LABEL, "class": "digit tie",
                              "how": "plain greedy against greedy decoding that takes the other side of the first "
                                     f"digit near-tie (fp32's top two, both digits, at most {DIGIT_TIE} logits apart) "
                                     "and goes on", "prompt_token_ids": ids, "a": plain[:at] + [token] + rest,
                              "b": plain})
            for bug in BUGS if seed in seeds else ():
                for at in CORRUPT_AT:
                    buggy = greedy_with_bug(loaded, ids, new_tokens, eos, bug, at)
                    where = first_divergence(buggy, plain)
                    log(f"seed {seed}, {bug} from output token {at + 1}: "
                        + ("no divergence" if where is None else f"parts at output token {where + 1}"))
                    if where is not None:
                        cases.append({"name": f"{bug} from token {at + 1}, seed {seed}", "label": BUG_LABEL,
                                      "class": bug, "how": BUGS[bug], "prompt_token_ids": ids, "a": buggy, "b": plain})
    return cases


def recorded_pairs(records: list[dict]) -> list[dict]:
    """Unlabelled divergences of real engines: each speculative run (first repeat) that parts from plain greedy
    on its prompt, once per prompt and position, from reproduction records of one model and host."""
    plain = {r["parameters"]["prompt_seed"]: r for r in records if r["parameters"]["method"] == "none"
             and r["parameters"]["configuration"] == r["parameters"]["baseline"] and r["results"]["repeats"]}
    pairs, seen = [], set()
    for r in sorted(records, key=lambda r: (r["parameters"]["prompt_seed"], r["parameters"]["configuration"])):
        seed = r["parameters"]["prompt_seed"]
        repeat = (r["results"]["repeats"] or [{}])[0]
        if r["parameters"]["method"] == "none" or seed not in plain or repeat.get("first_divergence") is None:
            continue
        if (seed, repeat["first_divergence"]) in seen:
            continue
        seen.add((seed, repeat["first_divergence"]))
        pair = pair_from_records(r, plain[seed])
        pairs.append({"name": f"{r['parameters']['configuration']} vs plain, seed {seed}",
                      "class": r["parameters"]["method"], "prompt_token_ids": pair["prompt_token_ids"],
                      "a": pair["a"], "b": pair["b"]})
    return pairs


def write_cases(path: str | Path | None = None, log=print) -> Path:
    """Build the labelled cases and keep them as data (with the weights they were built on)."""
    from spectie.fingerprint import model_digest
    from spectie.paths import project_root

    path = Path(path) if path else project_root() / CASES
    cases = build_cases(log=log)
    data = {"model": "organism", "model_sha256": model_digest("organism"), "tokens": CASE_TOKENS,
            "command": "python -m spectie.divergence cases", "cases": cases}
    lines = ",\n".join(json.dumps(case) for case in cases)  # one case per line
    head = json.dumps({k: v for k, v in data.items() if k != "cases"})[:-1]
    path.write_text(f'{head}, "cases": [\n{lines}\n]}}\n')
    log(f"{len(cases)} labelled cases: {path}")
    return path


def read_cases(path: str | Path | None = None) -> dict:
    from spectie.paths import project_root

    path = Path(path) if path else project_root() / CASES
    if not path.is_file():
        raise UsageError(f"no labelled cases at {path}: run `python -m spectie.divergence cases`")
    return json.loads(path.read_text())


def classify_cases(cases: list[dict], model: str = "organism", threshold: float | None = None,
                   progress: bool = True, classifier=None) -> list[dict]:
    """The classifier on each labelled case: its verdict beside the truth. `classifier(prompt, a, b)` replaces
    `classify` with `model` and `threshold` (e.g. one that reuses verdicts already computed)."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar for the cases, not one per model load
    classifier = classifier or (lambda prompt, a, b: classify(model, prompt, a, b, threshold))
    rows = []
    for case in tqdm(cases, desc="classifying", mininterval=2, disable=not progress):
        result = classifier(case["prompt_token_ids"], case["a"], case["b"])
        called = {NEAR_TIE: NEAR_TIE_LABEL, SUSPECTED_BUG: BUG_LABEL}.get(result.verdict, result.verdict)
        rows.append({"case": case["name"], "truth": case.get("label"), "class": case["class"], "verdict": called,
                     "right": called == case["label"] if "label" in case else None,
                     "output token": None if result.position is None else result.position + 1,
                     "fp32 margin": result.reference_margin, "threshold": result.threshold})
    return rows


VERDICTS_KIND = "divergence-verdicts"


def write_verdicts(rows: list[dict], engine_records: list[dict], model: str, threshold: float, origin: str,
                   environment: str, content_hash: str, started_at: str) -> dict:
    """A measured record of the classifier's verdicts on the divergences a vLLM environment wrote (the
    rows of `classify_cases` on its `recorded_pairs`): computed on this host, about the engine outputs of
    `engine_records`' environment, with the band used. The summary reads it instead of classifying again."""
    from spectie.fingerprint import host_id
    from spectie.records import measured_path, measured_record, read_if_valid, write_record

    source = engine_records[0]
    parameters = {"model": model, "engine_environment": source["environments"][0],
                  "engine_vllm": source["fingerprint"]["vllm"], "engine_device": source["fingerprint"]["gpu"] or "CPU",
                  "threshold": threshold, "threshold_origin": origin}
    record = measured_record(
        record_id=f"{VERDICTS_KIND}-{source['environments'][0]}-{host_id()}".lower(), kind=VERDICTS_KIND,
        chapter="guidance", environment=environment, parameters=parameters,
        title=f"Classifier verdicts on vLLM {parameters['engine_vllm']}'s divergences ({parameters['engine_environment']})",
        results={"rows": [{k: v for k, v in row.items() if k not in ("truth", "right")} for row in rows]},
        started_at=started_at, content_hash=content_hash, dtype="float32")
    path = measured_path(record)
    earlier = read_if_valid(path)  # the same verdicts on the same divergences with the same band: it stands, unchanged
    if earlier and earlier["parameters"] == record["parameters"] and same_rows(earlier["results"]["rows"],
                                                                               record["results"]["rows"]):
        return earlier
    write_record(record, path)
    return record


MARGIN_TOLERANCE = 1e-4  # logits: fp32 margins move in the 6th decimal with the CPU thread count, nothing else does


def same_rows(earlier: list[dict], now: list[dict]) -> bool:
    """The same verdict rows, fp32 margins equal within MARGIN_TOLERANCE (a recomputation on another number of
    threads sums in another order; the verdicts and every other field must be identical)."""
    def close(a, b) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and abs(a - b) <= MARGIN_TOLERANCE)

    return len(earlier) == len(now) and all(
        row.keys() == other.keys() and all(close(row[k], other[k]) if k == "fp32 margin" else row[k] == other[k]
                                           for k in row) for row, other in zip(earlier, now))


def confusion(rows: list[dict]):
    """Truth (rows) against the classifier's verdict (columns), counts."""
    import pandas as pd

    table = pd.crosstab(pd.Series([r["truth"] for r in rows], name="truth"),
                        pd.Series([r["verdict"] for r in rows], name="classifier says"))
    labels = [NEAR_TIE_LABEL, BUG_LABEL]
    return table.reindex(index=labels, columns=labels, fill_value=0)


def main(argv: list[str] | None = None) -> int:
    """python -m spectie.divergence cases: build the labelled cases on the organism into sources/."""
    import sys

    if (argv if argv is not None else sys.argv[1:]) != ["cases"]:
        print(main.__doc__)
        return 2
    write_cases()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
