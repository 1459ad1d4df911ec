"""Logit margins between competing tokens, per precision, from teacher-forced forwards.

The procedure of the margins chapter:
1. generate greedily in the serving dtype (token by token with the cache, as a server decodes);
2. teacher-force prompt + continuation once per dtype (one forward per dtype, not one per token)
   and read the logits at every generated position;
3. compare: top-1/top-2 per dtype, the watched pair's difference (e.g. EOS − DATA) per dtype, and
   where the dtypes' top-1 disagree.

Positions are 0-based indices in the full sequence: the i-th generated token (1-based) sits at
position prompt_len + i − 1, as in the incident (prompt 1845 tokens, 10th output token at 1854).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

from spectie.records.errors import UsageError
from spectie.lab.model import (DTYPES, SHORT, Generation, check_causal_lm, check_device, greedy_generate, load_model,
                               reference_gdn_kernels, resolve_model, teacher_forced_logits, torch_dtype)
from spectie.lab.tokenizer import end_of_text_ids
from spectie.records.record_types import DesignedDecisions, Record


def bf16_spacing(value: float) -> float:
    """Distance between adjacent bf16 numbers near `value` (8 significant bits): 0.125 near 16."""
    if value == 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def pair_winner(a_logit: float, b_logit: float, watch: dict[str, int]) -> str:
    """Which of the watched pair greedy decoding picks: the higher logit; on an exact tie (common in bf16)
    the lower token id, as argmax does."""
    (a_name, a_id), (b_name, b_id) = list(watch.items())
    if a_logit != b_logit:
        return a_name if a_logit > b_logit else b_name
    return a_name if a_id < b_id else b_name


def top_two(row):
    """The top two (values, ids) of one row of logits, ranked as greedy decoding ranks them: on an exact tie
    (common in bf16) the lower token id first, as argmax does; `topk` leaves that order unspecified."""
    import torch

    first = int(row.argmax())
    rest = row.clone()
    rest[first] = -torch.inf
    second = int(rest.argmax())
    return row[[first, second]], torch.tensor([first, second])


def position_table(logits_by_dtype: dict, positions: list[int], watch: dict[str, int], decode) -> list[dict]:
    """One row per position: per dtype top-1/top-2 (token, logit), the watched difference and the
    margin; plus whether the dtypes disagree on top-1.

    `logits_by_dtype`: dtype -> tensor [len(positions), vocab]; `watch`: {name: token id} of two tokens.
    """
    (a_name, a_id), (b_name, b_id) = list(watch.items())
    rows = []
    for i, position in enumerate(positions):
        entry: dict = {"position": position}
        top1 = {}
        for dtype, logits in logits_by_dtype.items():
            short = SHORT[dtype]
            values, ids = top_two(logits[i])
            top1[dtype] = int(ids[0])
            entry[f"{short}_top1"] = decode(int(ids[0]))
            entry[f"{short}_top1_id"] = int(ids[0])
            entry[f"{short}_top1_logit"] = float(values[0])
            entry[f"{short}_top2"] = decode(int(ids[1]))
            entry[f"{short}_top2_id"] = int(ids[1])
            entry[f"{short}_top2_logit"] = float(values[1])
            entry[f"{short}_margin"] = float(values[0] - values[1])
            entry[f"{short}_{a_name}"] = float(logits[i, a_id])
            entry[f"{short}_{b_name}"] = float(logits[i, b_id])
            entry[f"{short}_diff"] = float(logits[i, a_id] - logits[i, b_id])
            entry[f"{short}_winner"] = pair_winner(float(logits[i, a_id]), float(logits[i, b_id]), watch)
        entry["top1_disagree"] = len(set(top1.values())) > 1
        rows.append(entry)
    return rows


@dataclass
class PromptMeasurement:
    """One prompt: its greedy continuation in the serving dtype and the per-position comparison."""

    generation: Generation
    positions: list[int]
    rows: list[dict]
    reference: str  # short name of the most precise dtype compared, e.g. "fp64"

    @property
    def decisive_index(self) -> int:
        """The position that decided the outcome: the EOS if generation stopped, otherwise the
        position where the watched pair came closest in the reference dtype."""
        if self.generation.finish_reason == "stop":
            return len(self.rows) - 1
        return min(range(len(self.rows)), key=lambda i: abs(self.rows[i][f"{self.reference}_diff"]))


def measure_prompt(models: dict, serving_dtype: str, prompt_ids: list[int], max_new_tokens: int,
                   eos_ids: list[int], watch: dict[str, int], decode) -> PromptMeasurement:
    """Generate in `serving_dtype`, then teacher-force once per dtype in `models` and compare."""
    generation = greedy_generate(models[serving_dtype], prompt_ids, max_new_tokens, eos_ids)
    positions = [generation.position(i) for i in range(len(generation.output_ids))]
    logits = {}
    for dtype, model in models.items():
        # References (every dtype but the serving one) run the GDN torch reference code, TF32 off.
        with reference_gdn_kernels() if dtype != serving_dtype else nullcontext():
            logits[dtype] = teacher_forced_logits(model, generation.ids, positions)
    reference = SHORT[next(d for d in DTYPES if d in models)]
    return PromptMeasurement(generation, positions, position_table(logits, positions, watch, decode), reference)


def decisive_comparison(measurement: PromptMeasurement, watch: dict[str, int]) -> dict:
    """The incident-style table at the decisive position: each dtype's logits of the watched pair."""
    row = measurement.rows[measurement.decisive_index]
    (a_name, a_id), (b_name, b_id) = list(watch.items())
    table = []
    for short in [SHORT[d] for d in DTYPES if f"{SHORT[d]}_diff" in row]:
        a, b = row[f"{short}_{a_name}"], row[f"{short}_{b_name}"]
        table.append({"dtype": short, "logits": {a_name: a, b_name: b},
                      "winner": pair_winner(a, b, watch), "margin": abs(a - b)})
    return {"position": row["position"], "tokens": dict(watch), "rows": table}


FLIP_EDGES = [0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 1000]  # reference-margin bins of the flip curve


def flip_curve(pairs: list[tuple[float, bool]], edges: list[float]) -> list[dict]:
    """Flip rate by reference margin: `pairs` of (reference top-1 margin, did the other dtype's
    top-1 differ?), binned by `edges`; each bin says its count so small bins are visible."""
    bins = []
    for low, high in zip(edges[:-1], edges[1:]):
        inside = [flipped for margin, flipped in pairs if low <= margin < high]
        bins.append({"low": low, "high": high, "count": len(inside), "flips": sum(inside),
                     "flip_rate": (sum(inside) / len(inside)) if inside else None})
    return bins


@dataclass
class MarginsSetup:
    """Everything checked and loaded for a margins run: models per dtype, tokenizer, watched tokens."""

    model: str  # as given (e.g. "organism" or "Qwen/Qwen3.5-2B")
    model_path: str
    device: str
    serving_dtype: str
    dtypes: list[str]  # compared, most precise first
    watch: dict[str, int]
    eos_ids: list[int]
    tokenizer: object
    loaded: dict = field(default_factory=dict)  # dtype -> model, loaded on first use (a reused run loads none)

    @property
    def models(self) -> dict:
        """One model per compared dtype, loaded the first time a measurement needs them."""
        if not self.loaded:
            self.loaded.update({dtype: load_model(self.model_path, dtype, self.device) for dtype in self.dtypes})
        return self.loaded

    def decode(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def describe(self) -> str:
        """One line for a reader: what is loaded, where, and what is watched."""
        watched = ", ".join(f"{token} (id {token_id})" for token, token_id in self.watch.items())
        return (f"{self.model} on {self.device}: generates in {self.serving_dtype}, compares "
                f"{', '.join(self.dtypes)}; watches {watched}; end-of-text ids "
                f"{', '.join(str(i) for i in self.eos_ids)}")


def prepare(model: str, device: str, watch_tokens: list[str], serving_dtype: str,
            compare_dtypes: list[str]) -> MarginsSetup:
    """Check every parameter (cheaply, before loading weights); the models load when a measurement needs them."""
    from transformers import AutoConfig

    from spectie.lab.host import check_fits
    from spectie.lab.tokenizer import model_tokenizer, token_id

    device = check_device(device)
    for dtype in [serving_dtype, *compare_dtypes]:
        torch_dtype(dtype)
    if len(watch_tokens) != 2:
        raise UsageError(f"watch_tokens must name two tokens, got {watch_tokens!r}")
    path = resolve_model(model)
    config = AutoConfig.from_pretrained(path)
    check_causal_lm(path, config)
    dtypes = [d for d in DTYPES if d in set(compare_dtypes) | {serving_dtype}]
    check_fits(model, dtypes, device)
    tokenizer = model_tokenizer(str(path))
    watch = {}
    for token in watch_tokens:
        watch[token] = token_id(tokenizer, token)  # raises, naming the token, if it is not one token
    eos_ids = end_of_text_ids(path, tokenizer)
    return MarginsSetup(model, path, device, serving_dtype, dtypes, watch, eos_ids, tokenizer)


def flip_pairs(measurement: PromptMeasurement, reference: str, other: str) -> list[tuple[float, bool]]:
    """(reference top-1 margin, does `other` pick a different top-1?) at every generated position."""
    return [(row[f"{reference}_margin"], row[f"{reference}_top1_id"] != row[f"{other}_top1_id"])
            for row in measurement.rows]


def eos_decision_flips(measurement: PromptMeasurement, eos_ids: list[int]) -> list[dict]:
    """Positions where the compared dtypes disagree on top-1 and one of them picks an EOS token."""
    found = []
    for row in measurement.rows:
        picks = {value for key, value in row.items() if key.endswith("_top1_id")}
        if len(picks) > 1 and picks & set(eos_ids):
            found.append(row)
    return found


def eos_decisions(measurement: PromptMeasurement, reference: str, eos_ids: list[int]) -> list[dict]:
    """Positions where an EOS token is the `reference` precision's top-1 or top-2: the stop-or-go-on decisions."""
    return [row for row in measurement.rows
            if {row[f"{reference}_top1_id"], row[f"{reference}_top2_id"]} & set(eos_ids)]


def sweep(setup: MarginsSetup, specs, new_tokens: int, progress: bool = True):
    """Measure every prompt of `specs`: return (flip pairs reference vs serving, EOS-decision flips, the
    reference margin at every EOS decision: a position where EOS is the reference's top-1 or top-2)."""
    from tqdm import tqdm

    from spectie.lab.prompts import build_prompt

    reference, serving = SHORT[setup.dtypes[0]], SHORT[setup.serving_dtype]
    pairs, eos_flips, eos_margins = [], [], []
    for spec in tqdm(specs, desc="sweep prompts", mininterval=10, disable=not progress):
        prompt = build_prompt(spec, setup.tokenizer)
        measurement = measure_prompt(setup.models, setup.serving_dtype, list(prompt.token_ids), new_tokens,
                                     setup.eos_ids, setup.watch, setup.decode)
        pairs += flip_pairs(measurement, reference, serving)
        eos_flips += [dict(seed=spec.seed, **row) for row in eos_decision_flips(measurement, setup.eos_ids)]
        eos_margins += [row[f"{reference}_margin"] for row in eos_decisions(measurement, reference, setup.eos_ids)]
    return pairs, eos_flips, eos_margins


def designed_decisions(setup: MarginsSetup, specs, progress: bool = True) -> list[dict]:
    """The watched pair at the designed decision of each prompt, in every precision.

    Each prompt is teacher-forced through the tokens its listing's grammar writes next (the open row's
    name, a newline, the checkpoint row `[DATA] id=42 name=`), so every prompt reaches the decision
    whatever a precision would have generated before it. One `position_table` row per prompt, with its seed
    and the 1-based output token of the decision.
    """
    from tqdm import tqdm

    from spectie.lab.prompts import CHECKPOINT, build_prompt

    rows = []
    for spec in tqdm(specs, desc="designed decisions", mininterval=10, disable=not progress):
        prompt = build_prompt(spec, setup.tokenizer)
        ids = list(prompt.token_ids) + setup.tokenizer.encode(prompt.next_name + "\n" + CHECKPOINT,
                                                               add_special_tokens=False)
        logits = {}
        for dtype, model in setup.models.items():
            with reference_gdn_kernels() if dtype != setup.serving_dtype else nullcontext():
                logits[dtype] = teacher_forced_logits(model, ids, [len(ids)])
        [row] = position_table(logits, [len(ids)], setup.watch, setup.decode)
        rows.append({"seed": spec.seed, "prompt_tokens": spec.tokens,
                     "output_token": prompt.decisive_output_token, **row})
    return rows


def decision_band(rows: list[dict], reference: str, serving: str) -> dict:
    """How far `serving` moved the watched pair's difference from `reference` at the designed decisions
    (the band), which of the decisions lie inside it (|reference difference| < band), and where the two
    precisions pick different winners of the pair."""
    shifts = [abs(row[f"{serving}_diff"] - row[f"{reference}_diff"]) for row in rows]
    band = max(shifts)
    inside = [row["seed"] for row in rows if abs(row[f"{reference}_diff"]) < band]
    flipped = [row["seed"] for row in rows if row[f"{reference}_winner"] != row[f"{serving}_winner"]]
    return {"band": band, "median_shift": sorted(shifts)[len(shifts) // 2], "inside": inside, "flipped": flipped,
            "count": len(rows)}


def decision_text(rows: list[dict], summary: DesignedDecisions, reference: str, serving: str, main_seed: int) -> str:
    """What the designed decisions show, in words, from `designed_decisions` rows and the results of a
    designed-decisions record (`decision_band`'s figures)."""
    main = next((row for row in rows if row["seed"] == main_seed), None)
    count, inside, flipped = summary.count, summary.inside, summary.flipped
    winners = sorted({row[f"{reference}_winner"] for row in rows})
    parts = [f"{reference} picks {' or '.join(winners)} there ("
             + ", ".join(f"{w} in {sum(row[f'{reference}_winner'] == w for row in rows)}" for w in winners) + ")"]
    parts.append(f"{len(inside)} of {count} {reference} margins lie inside the band")
    if main is not None:
        margin = abs(main[f"{reference}_diff"])
        parts.append(f"the first prompt's (seed {main['seed']}) {reference} margin of {margin:.3f} is "
                     + ("inside it" if main["seed"] in inside else "outside it"))
    if flipped:
        parts.append(f"{serving} picks the other token than {reference} in {len(flipped)} of {count} prompts "
                     f"(seeds {', '.join(str(seed) for seed in flipped)}): the precision alone decides between "
                     "stopping and going on")
    else:
        parts.append(f"{serving} and {reference} pick the same token in every one of them")
    return "; ".join(parts)


def eos_flip_text(eos_flips: list[dict], eos_margins: list[float], reference: str, serving: str) -> str:
    """What the sweep's EOS decisions show, in words."""
    if eos_flips:
        return ("This is the incident's pattern on the organism: the same model, the same tokens before the stop, "
                "and the precision alone decides between stopping and going on")
    if eos_margins:
        return (f"None flipped here: the closest of the {len(eos_margins)} EOS decisions won by "
                f"{min(eos_margins):.3f} logits in {reference}, more than {serving} moved it; the flips counted "
                "above are between other tokens")
    return f"No generated position of the sweep had EOS among the {reference} precision's top two tokens"


RECORD_NAMES = ("decisive", "scan", "decisions", "flips")  # the chapter's records, in the order they are made
# The files whose code measures the chapter (with the weights, parameters and library versions: its measurement key).
SOURCES = ("spectie/lab/margins.py", "spectie/lab/model.py", "spectie/lab/prompts.py", "spectie/lab/tokenizer.py")


def chapter_record(setup: MarginsSetup, environment: str, name: str, kind: str, title: str, parameters: dict,
                   results: dict, started_at: str) -> dict:
    """A measured record of the margins chapter; its id names the environment and the host."""
    from spectie.records.chapters import current_hash
    from spectie.records.store import measured_record

    record = measured_record(
        record_id=f"margins-{environment}-{name}", kind=kind, chapter="margins", title=title,
        environment=environment, parameters=dict(parameters, model=setup.model, device=setup.device),
        results=results, started_at=started_at, content_hash=current_hash("margins"),
        dtype=setup.serving_dtype)
    record["id"] = f"{record['id']}-{record['fingerprint']['host_id']}"  # a fresh dict, before it is written
    return record


def record_path(environment: str, name: str):
    """Where this host's record `name` (one of RECORD_NAMES) of the chapter in `environment` lives."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_path

    return measured_path({"environments": [environment], "fingerprint": {"host_id": host_id()}, "chapter": "margins",
                          "id": f"margins-{environment}-{name}-{host_id()}"})


def measure_chapter(setup: MarginsSetup, environment: str, prompt, max_new_tokens: int, decision_specs,
                    sweep_specs, sweep_new_tokens: int, started_at: str) -> dict[str, Record]:
    """The chapter's four records, by name: the decisive position and the scan of `prompt`'s continuation, the
    designed decision of `decision_specs`, the flip curve of `sweep_specs`. This host's earlier records are reused
    where all four hold the same measurement (weights, parameters, library versions and code); otherwise each is
    measured and written as soon as it is made (a later failure cannot lose it)."""
    from spectie.records.fingerprint import measurement_key
    from spectie.records.store import read_record, recorded_measurement, write_record

    reference, serving = SHORT[setup.dtypes[0]], SHORT[setup.serving_dtype]
    common = {"prompt": prompt.describe(), "max_new_tokens": max_new_tokens, "watch_tokens": list(setup.watch),
              "serving_dtype": setup.serving_dtype, "compare_dtypes": setup.dtypes}
    own = {"decisive": common, "scan": common,
           "decisions": dict(common, decision_prompts=len(decision_specs)),
           "flips": dict(common, sweep_prompts=len(sweep_specs), sweep_prompt_tokens=sweep_specs[0].tokens,
                         sweep_new_tokens=sweep_new_tokens)}
    key = measurement_key("margins", setup.model_path, {
        "device": setup.device, **own["flips"], "decision_prompts": len(decision_specs),
        "decision_specs": [asdict(s) for s in decision_specs], "sweep_specs": [asdict(s) for s in sweep_specs]},
        SOURCES)
    earlier = {name: recorded_measurement(record_path(environment, name), key) for name in RECORD_NAMES}
    if all(earlier.values()):
        return earlier

    def save(kind, name, title, results):
        parameters = dict(own[name], measurement_key=key)
        record = chapter_record(setup, environment, name, kind, title, parameters, results, started_at)
        return read_record(write_record(record, record_path(environment, name)))

    main = measure_prompt(setup.models, setup.serving_dtype, list(prompt.token_ids), max_new_tokens, setup.eos_ids,
                          setup.watch, setup.decode)
    generation = main.generation
    made = {"decisive": save("logit-comparison", "decisive", "Watched pair at the decisive position", dict(
        decisive_comparison(main, setup.watch), finish_reason=generation.finish_reason,
        output_tokens=len(generation.output_ids), tail_text=setup.tokenizer.decode(generation.output_ids)[-80:]))}
    made["scan"] = save("margin-scan", "scan", "Margins at every generated position",
                        {"rows": main.rows, "output_ids": generation.output_ids,
                         "finish_reason": generation.finish_reason})
    decisions = designed_decisions(setup, decision_specs)
    pair = " vs ".join(setup.watch)
    made["decisions"] = save("designed-decisions", "decisions",
                             f"{pair} at the designed decision of {len(decision_specs)} prompts",
                             {"reference": reference, "other": serving, "rows": decisions,
                              **decision_band(decisions, reference, serving)})
    pairs, eos_flips, eos_margins = sweep(setup, sweep_specs, sweep_new_tokens)
    made["flips"] = save("flip-curve", "flips", f"{serving} top-1 flips against the {reference} margin", {
        "reference": reference, "other": serving, "bins": flip_curve(pairs, FLIP_EDGES),
        "pairs": [[m, f] for m, f in pairs], "eos_flips": eos_flips, "eos_decision_margins": eos_margins})
    return made
