"""Tables of the incident chapter, built from the reported records (nothing is typed twice)."""

from __future__ import annotations

from dataclasses import fields

import pandas as pd

from spectie.records.environments import load_environments
from spectie.records.record_types import EngineConfiguration, EngineOutcome, IncidentParameters, LogitComparison, Record

NOT_REPORTED = "—"


def _k_label(k) -> str:
    if k is None:
        return "K not stated"
    if isinstance(k, list):
        return "K ∈ {" + ", ".join(str(v) for v in k) + "}"
    return f"K = {k}"


def configuration_label(parameters: EngineConfiguration) -> str:
    """A short, stable name for an engine configuration, e.g. 'mtp (V2), K ∈ {7, 8}, eager'."""
    method = parameters.method
    if method == "none":
        parts = ["plain greedy (no speculation)"]
    else:
        name = method if method else "method not stated"
        if parameters.model_runner:
            name += f" ({parameters.model_runner})"
        parts = [name, _k_label(parameters.num_speculative_tokens)]
    if parameters.enforce_eager is True and parameters.cudagraph_mode is None:
        parts.append("eager")
    if parameters.enforce_eager is False:
        parts.append("compiled")
    if parameters.cudagraph_mode:
        parts.append(f"cudagraph_mode={parameters.cudagraph_mode}")
    return ", ".join(parts)


def _short_gpu(hardware: dict) -> str:
    gpu = (hardware.get("gpu") or "CPU").removeprefix("NVIDIA ").removeprefix("GeForce ")
    return f"{hardware['gpu_count']} × {gpu}" if (hardware.get("gpu_count") or 0) > 1 else gpu


def environment_label(env_ids: tuple[str, ...] | list[str], environments: dict[str, dict]) -> str:
    """A short label such as 'vLLM v0.31.0 · 2 × RTX 4090'; several ids read 'X or Y · GPU'."""
    if not env_ids:
        return "environment not stated"
    envs = [environments[e] for e in env_ids]
    versions = [f"v{e['vllm']['version']}" if e["vllm"].get("version") else f"nightly {e['vllm']['commit']}"
                for e in envs]
    gpus = list(dict.fromkeys(_short_gpu(e["hardware"]) for e in envs))
    return f"vLLM {' or '.join(versions)} · {' / '.join(gpus)}"


def outcome_label(results: EngineOutcome) -> str:
    """What happened, in the words of the matrix: 'stopped 10/10 at prompt_len+8' (the report's count),
    'stopped 3/3 after 92 tokens' (a measured one: tokens written before the end-of-text), 'continued'."""
    if not results.stopped_early:
        return "continued"
    text = "stopped"
    if results.runs_total:
        text += f" {results.runs_stopped}/{results.runs_total}"
    if results.stop_offset_from_prompt_len is not None:
        text += f" at prompt_len+{results.stop_offset_from_prompt_len}"
    elif results.output_tokens_before_stop is not None:
        text += f" after {results.output_tokens_before_stop} tokens"
    return text


def outcomes_table(records: list[Record]) -> pd.DataFrame:
    """One row per engine-outcome record: environment, configuration, outcome, provenance, source."""
    environments = load_environments()
    rows = []
    for r in records:
        if r.kind != "engine-outcome":
            continue
        rows.append({
            "environment": environment_label(r.environments, environments),
            "configuration": configuration_label(r.parameters),
            "outcome": outcome_label(r.results),
            "provenance": r.provenance,
            "where from": r.source.section if r.provenance == "reported" else r.fingerprint.host_id,
            "record": r.id,
        })
    return pd.DataFrame(rows)


def outcome_matrix(records: list[Record]) -> pd.DataFrame:
    """Configuration × environment matrix of outcomes; '—' where nothing was reported."""
    table = outcomes_table(records)
    matrix = table.pivot_table(index="configuration", columns="environment", values="outcome",
                               aggfunc=lambda cells: "; ".join(cells), sort=False)
    return matrix.fillna(NOT_REPORTED)


def style_matrix(matrix: pd.DataFrame):
    """Colour the matrix: red for early stops, green for runs that continued."""
    def colour(cell: str) -> str:
        if cell.startswith("stopped"):
            return "background-color: #f4cccc"
        if cell == "continued":
            return "background-color: #d9ead3"
        return "color: #888888"
    return (matrix.style.map(colour)
            .set_caption("Reported outcomes: engine configuration × environment (greedy decoding)")
            .set_table_attributes('class="outcome-matrix"'))


def logit_comparison(reported: list[Record]) -> Record:
    """The incident's reported logit comparison at its stop (fp32 and bf16 transformers references)."""
    return next(r for r in reported if r.kind == "logit-comparison")


def fp32_row(reported: list[Record]) -> dict:
    """The fp32 row of the incident's reported logit comparison (margin, winner, logits)."""
    return next(row for row in logit_comparison(reported).results.rows if row["dtype"] in ("fp32", "float32"))


def logit_table(record: Record) -> pd.DataFrame:
    """The fp32/bf16 logit comparison of a logit-comparison record, one row per dtype."""
    results: LogitComparison = record.results
    tokens = list(results.tokens)
    rows = []
    for row in results.rows:
        entry = {"dtype": row["dtype"]}
        entry.update({f"{t} logit": row["logits"][t] for t in tokens})
        entry["top-1"] = row["winner"]
        entry["wins by"] = row["margin"]
        rows.append(entry)
    return pd.DataFrame(rows).set_index("dtype")


def logit_values(record: Record) -> dict[str, float | str]:
    """Flat name -> value pairs of a logit comparison, for glue: e.g. fp32_EOS, bf16_margin."""
    values: dict[str, float | str] = {"position": record.results.position}
    for row in record.results.rows:
        for token, logit in row["logits"].items():
            values[f"{row['dtype']}_{token}"] = logit
        values[f"{row['dtype']}_winner"] = row["winner"]
        values[f"{row['dtype']}_margin"] = row["margin"]
    return values


def positions_text(prompt_tokens: int, offset: int, tokens_before: int, logit_position: int) -> str:
    """The report's three names for the stop — `prompt_len + offset`, "after output token N" and the logits
    at a sequence position — set against one another (0-based positions: the prompt fills 0 … prompt_len-1;
    output token k, 1-based, sits at prompt_len + k - 1 and is chosen by the logits at prompt_len + k - 2)."""
    eos_index = prompt_tokens + tokens_before  # the end-of-text token comes after `tokens_before` output tokens
    chooser = eos_index - 1  # the position whose logits chose it
    agree = "agrees" if chooser == logit_position else "does not agree"
    offset_names = ("the logits that chose it" if prompt_tokens + offset == chooser else
                    "the end-of-text token itself" if prompt_tokens + offset == eos_index else
                    "neither the end-of-text token nor the logits that chose it")
    return (f"counted from 0, the prompt fills positions 0 to {prompt_tokens - 1}; after {tokens_before} output "
            f"tokens the end-of-text token sits at {eos_index} and was chosen by the logits at {chooser}, which "
            f"{agree} with the reference's position {logit_position}; `prompt_len + {offset}` = "
            f"{prompt_tokens + offset} names {offset_names}"
            + (": the report's counts do not agree with one another" if offset_names.startswith("neither")
               else ": the three name one stop"))


def page_values(records: list[Record]) -> dict:
    """The chapter's glue values from the incident's records: its source, the configuration it ran, the symptom
    (where the stop fell, what it wrote last), the v0.32.0 and B200 runs, and the reported logits."""
    by_id = {r.id: r for r in records}
    configuration, symptom = by_id["incident-configuration"], by_id["original-ngram_gpu-wide-verify"].results
    logits = by_id["hf-reference-logits-1854"]
    parameters: IncidentParameters = configuration.parameters
    v032 = [r for r in records if "v0.32.0-rtx4090" in r.environments]
    values = {
        "source_title": configuration.source.title, "source_document": configuration.source.document,
        **{key: getattr(parameters, key) for key in ("max_tokens", "prompt_tokens", "linear_to_full_attention_ratio")},
        "k_tested": "{" + ", ".join(str(k) for k in parameters.num_speculative_tokens_tested) + "}",
        "claimed_min_k": configuration.results.claimed_min_k,
        **{f"id_{token.strip('<|>')}": token_id for token, token_id in configuration.results.token_ids.items()},
        "stop_offset": symptom.stop_offset_from_prompt_len, "tokens_before_stop": symptom.output_tokens_before_stop,
        "tail_text": symptom.tail_text, "symptom_tokens": symptom.output_tokens_before_stop,
        "positions_text": positions_text(parameters.prompt_tokens, symptom.stop_offset_from_prompt_len,
                                         symptom.output_tokens_before_stop, logits.results.position),
        "v032_runs_stopped": sum(r.results.runs_stopped for r in v032),
        "v032_runs_total": sum(r.results.runs_total for r in v032), "v032_configurations": len(v032),
        **{k: v for k, v in b200_facts(records).items() if k != "b200_k_text"}}
    values.update({f"logit_{name}": value for name, value in logit_values(logits).items()})
    return values


def b200_k_measure(records: list[Record]) -> dict:
    """The values of K at which the speculative runs among `records` stopped early, and at which they went on."""
    by_k = sorted((r.parameters.num_speculative_tokens, bool(r.results.stopped_early)) for r in records
                  if r.kind == "engine-outcome"
                  and isinstance(getattr(r.parameters, "num_speculative_tokens", None), int))  # a list: a sweep
    return {"stops_at": [k for k, stopped in by_k if stopped], "goes_on": [k for k, stopped in by_k if not stopped]}


def b200_facts(reported: list[Record]) -> dict:
    """The glue values of the incident's B200 runs by K (reported): at which K they stopped early, at which they went
    on, and whether that contradicts a K threshold (`b200_k_text`: all of it, as a claim naming those runs)."""
    from spectie.book.claims import Claim, Scope

    b200 = [r for r in reported if r.id.startswith("b200-")]
    facts = b200_k_measure(b200)
    stops_at, goes_on = facts["stops_at"], facts["goes_on"]
    verdict = ("a wider K did not stop where a narrower one did, so no K threshold holds"
               if any(k > s for k in goes_on for s in stops_at) else "these runs alone do not contradict a K threshold")
    words = "the incident's B200"
    scope = Scope(words, "engine-outcome", "reported", tuple(sorted({r.environment for r in b200})))
    shown = ", ".join(map(str, stops_at)) or "—", ", ".join(map(str, goes_on)) or "—"
    return {"b200_k_stops": shown[0], "b200_k_continues": shown[1], "k_threshold_text": verdict,
            "b200_k_text": Claim("b200_k_text", f"{words} stopped at K = {shown[0]} and not at K = {shown[1]} "
                                 f"(reported): {verdict}", scope, "spectie.book.incident:b200_k_measure", facts)}


def configuration_table(parameters: IncidentParameters) -> pd.DataFrame:
    """The incident's configuration as a two-column table, settings in alphabetical order, as the record stores
    them (lists joined, booleans in words; a setting the record leaves out is not shown)."""
    def shown(value):
        if isinstance(value, list):
            return ", ".join(map(str, value))
        return {True: "yes", False: "no"}[value] if isinstance(value, bool) else value

    stated = sorted((f.name, getattr(parameters, f.name)) for f in fields(parameters))
    return pd.DataFrame([(key, shown(value)) for key, value in stated if value is not None],
                        columns=["setting", "value"]).set_index("setting")
