"""The classifier's labelled cases: divergences whose truth is known by construction, built once on the organism and
kept as data (sources/classifier_cases.json): near-ties (the designed end-of-text/DATA tie, digit ties) and planted
bugs of each public class (BUGS, planted by `greedy_with_bug`); the classifier on cases, labelled or not (the
divergences of real engines, `recorded_pairs`), and its score against the truth (`confusion`).

    python -m spectie.tools.divergence_cases build     # rebuild the cases (minutes on a CPU)
"""

from __future__ import annotations

import json
from pathlib import Path

from spectie.tools import divergence
from spectie.tools.divergence import Verdict, pair_from_records
from spectie.records.errors import UsageError
from spectie.records.record_types import Record


CASES = "sources/classifier_cases.json"  # the labelled cases, built once on the organism and kept as data


CASE_SEEDS = (0, 1, 2)  # planted bugs


TIE_SEEDS = tuple(range(8))  # designed ties


CORRUPT_AT = (0, 14)  # the planted bug from the first output token on, or from output token 15 on


CASE_TOKENS = 48


DIGIT_TIE = 0.05  # a digit near-tie of the labelled cases: fp32's top two tokens, both digits, at most this far apart


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


def corrupt_states(bug: str, step: int, corrupt_at: int, layers: list, saved: list) -> None:
    """The state bugs of BUGS at output token `step`, in place on the GDN layers' cache (`saved`: their recurrent
    states at the prompt's end): lost from `corrupt_at` on, stale from `corrupt_at` on, or the convolution state
    rolled by one position once, at `corrupt_at`."""
    if bug == "lost-state" and step >= corrupt_at:
        for layer in layers:
            layer.recurrent_states[0].zero_()
    elif bug == "stale-state" and step >= corrupt_at:
        for layer, state in zip(layers, saved):
            layer.recurrent_states[0].copy_(state)
    elif bug == "conv-offset" and step == corrupt_at:
        for layer in layers:
            layer.conv_states[0].copy_(layer.conv_states[0].roll(1, dims=-1))


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
                corrupt_states(bug, step, corrupt_at, layers, saved)
                shifted["on"] = step >= corrupt_at
                out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return output


def digit_tie(reference, prompt_ids: list[int], output: list[int], decode) -> tuple[int, int] | None:
    """The first output position where the fp32 `reference` puts two digits on top at most DIGIT_TIE logits apart
    and `output` wrote one of them, and the other one: (position, token); None if there is none."""
    from spectie.lab.model import teacher_forced_logits

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
    from spectie.lab.model import greedy_generate, load_model, reference_gdn_kernels, resolve_model
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.records.completions import first_divergence
    from spectie.lab.tokenizer import end_of_text_ids, model_tokenizer

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
            cases.append({"name": f"designed tie, seed {seed}", "label": Verdict.NEAR_TIE.label, "class": "designed tie",
                          "how": "plain greedy against the same text taking the other side of the designed "
                                 "end-of-text/DATA tie (stop against continue)",
                          "prompt_token_ids": ids, "a": plain[:decision] + [other], "b": plain})
            tie = digit_tie(reference, ids, plain, lambda token: tokenizer.decode([token]))
            if tie is not None:
                at, token = tie
                rest = greedy_generate(loaded, ids + plain[:at] + [token], new_tokens - at - 1, eos).output_ids \
                    if at + 1 < new_tokens and token not in eos else []
                cases.append({"name": f"digit tie, seed {seed}", "label": Verdict.NEAR_TIE.label, "class": "digit tie",
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
                        cases.append({"name": f"{bug} from token {at + 1}, seed {seed}", "label": Verdict.BUG.label,
                                      "class": bug, "how": BUGS[bug], "prompt_token_ids": ids, "a": buggy, "b": plain})
    return cases


def recorded_pairs(records: list[Record]) -> list[dict]:
    """Unlabelled divergences of real engines: each speculative run (first repeat) that parts from plain greedy
    on its prompt, once per prompt and position, from reproduction records of one model and host."""
    plain = {r.parameters.prompt_seed: r for r in records if r.parameters.method == "none"
             and r.is_baseline and r.results.repeats}
    pairs, seen = [], set()
    for r in sorted(records, key=lambda r: (r.parameters.prompt_seed, r.parameters.configuration)):
        seed = r.parameters.prompt_seed
        repeat = (r.results.repeats or [{}])[0]
        if r.parameters.method == "none" or seed not in plain or repeat.get("first_divergence") is None:
            continue
        if (seed, repeat["first_divergence"]) in seen:
            continue
        seen.add((seed, repeat["first_divergence"]))
        pair = pair_from_records(r, plain[seed])
        pairs.append({"name": f"{r.parameters.configuration} vs plain, seed {seed}",
                      "class": r.parameters.method, "prompt_token_ids": pair["prompt_token_ids"],
                      "a": pair["a"], "b": pair["b"]})
    return pairs


def write_cases(path: str | Path | None = None, log=print) -> Path:
    """Build the labelled cases and keep them as data (with the weights they were built on)."""
    from spectie.records.fingerprint import model_digest
    from spectie.records.paths import project_root

    path = Path(path) if path else project_root() / CASES
    cases = build_cases(log=log)
    data = {"model": "organism", "model_sha256": model_digest("organism"), "tokens": CASE_TOKENS,
            "command": "python -m spectie.tools.divergence_cases build", "cases": cases}
    lines = ",\n".join(json.dumps(case) for case in cases)  # one case per line
    head = json.dumps({k: v for k, v in data.items() if k != "cases"})[:-1]
    path.write_text(f'{head}, "cases": [\n{lines}\n]}}\n')
    log(f"{len(cases)} labelled cases: {path}")
    return path


def read_cases(path: str | Path | None = None) -> dict:
    from spectie.records.paths import project_root

    path = Path(path) if path else project_root() / CASES
    if not path.is_file():
        raise UsageError(f"no labelled cases at {path}: run `python -m spectie.tools.divergence_cases build`")
    return json.loads(path.read_text())


def classify_cases(cases: list[dict], model: str = "organism", threshold: float | None = None,
                   progress: bool = True, classifier=None) -> list[dict]:
    """The classifier on each labelled case: its verdict beside the truth. `classifier(prompt, a, b)` replaces
    `classify` with `model` and `threshold` (e.g. one that reuses verdicts already computed)."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar for the cases, not one per model load
    classifier = classifier or (lambda prompt, a, b: divergence.classify(model, prompt, a, b, threshold))
    rows = []
    for case in tqdm(cases, desc="classifying", mininterval=2, disable=not progress):
        result = classifier(case["prompt_token_ids"], case["a"], case["b"])
        called = result.verdict.label  # as case files store it
        rows.append({"case": case["name"], "truth": case.get("label"), "class": case["class"], "verdict": called,
                     "right": called == case["label"] if "label" in case else None,
                     "output_token": None if result.position is None else result.position + 1,
                     "fp32_margin": result.reference_margin, "threshold": result.threshold})
    return rows


def confusion(rows: list[dict]):
    """Truth (rows) against the classifier's verdict (columns), counts."""
    import pandas as pd

    table = pd.crosstab(pd.Series([r["truth"] for r in rows], name="truth"),
                        pd.Series([r["verdict"] for r in rows], name="classifier says"))
    labels = [Verdict.NEAR_TIE.label, Verdict.BUG.label]
    return table.reindex(index=labels, columns=labels, fill_value=0)


def main(argv: list[str] | None = None) -> int:
    """python -m spectie.tools.divergence_cases build: build the labelled cases on the organism into sources/."""
    import sys

    if (argv if argv is not None else sys.argv[1:]) != ["build"]:
        print(f"error: usage: {main.__doc__}", file=sys.stderr)
        return 2
    write_cases()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
