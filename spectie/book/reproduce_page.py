"""The reproduction chapter's page, from its engine-outcome records: its glue values (`run_values`, `prose_values`),
every configuration across a run's prompts (a table, a sentence, a dot plot of where it first parts from plain
greedy), and each host's recorded run in words (`run_summary`, `other_runs`). One run's tables: spectie.book.reproduce.

    values = reproduce_page.run_values(plan, records, all_records)   # plan: spectie.engines.plan.Plan
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import pandas as pd

from spectie.lab import qwen_shapes, sweeps
from spectie.engines.runner import root_cause
from spectie.records.completions import stop_moved
from spectie.records.record_types import Record
from spectie.book.reproduce import (CONTEXT_TOKENS, decision_text, first_prompt, measured_runs, parting_text, prompt_seed,
                               RunKey, run_key, run_label)


def first_parting(record: Record) -> int | None:
    """The first output token (1-based) where any repeat of a run parts from the baseline, None if none does."""
    at = [x["first_divergence"] for x in record.results.repeats if x["first_divergence"] is not None]
    return min(at) + 1 if at else None


def seeds_rows(records: list[Record], baseline: str | None) -> list[dict]:
    """Per configuration, over every prompt seed it ran on: how often its output parts from the baseline's
    (any repeat), where (1-based output tokens), and how its stop compares with the baseline's (first repeats)."""
    base = {prompt_seed(r): r.results for r in records
            if r.parameters.configuration == baseline and r.results.repeats}
    by_config: dict[str, list[Record]] = {}
    for r in records:
        by_config.setdefault(r.parameters.configuration, []).append(r)
    rows = []
    for config, runs in by_config.items():
        ran = sorted((r for r in runs if r.results.repeats and prompt_seed(r) in base), key=prompt_seed)
        parted, stops = [], {"same": 0, "earlier": 0, "later": 0, "only here": 0, "only in the baseline": 0}
        for r in ran:
            at = first_parting(r)
            if at is not None:
                parted.append(at)
            stops[stop_moved(r.results.repeats[0], base[prompt_seed(r)].repeats[0])] += 1
        rows.append({
            "configuration": config,
            "status": ", ".join(sorted({r.results.status for r in runs})),
            "prompts": len(ran),
            "stopped early (first repeat)": f"{sum(r.results.repeats[0]['finish_reason'] == 'stop' for r in ran)}"
                                            f"/{len(ran)}",
            "parts from the baseline": "baseline" if config == baseline else f"{len(parted)}/{len(ran)}",
            "where (output token)": ", ".join(str(p) for p in sorted(parted)) or "—",
            "stop moved": "—" if config == baseline else
            ", ".join(f"{n} {what}" for what, n in stops.items() if n and what != "same") or "never",
        })
    return rows


def parting_plot(records: list[Record], baseline: str | None, decisive_output_token: int | None, title: str):
    """Where each configuration first parts from the baseline, one dot per prompt: the first output token
    (any repeat) that differs; a hollow dot at the right edge where every repeat wrote the baseline's tokens
    to the end. A dashed line marks the designed decision, where the model has one."""
    base = {prompt_seed(r) for r in records if r.parameters.configuration == baseline and r.results.repeats}
    configs: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: r.parameters.configuration):
        if r.parameters.configuration != baseline:
            configs.setdefault(r.parameters.configuration, []).append(r)
    longest = max((x["output_tokens"] for r in records for x in r.results.repeats), default=1)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(configs) + 1.4))
    for row, (name, runs) in enumerate(configs.items()):
        ran = [r for r in runs if r.results.repeats and prompt_seed(r) in base]
        parted = [at for at in map(first_parting, ran) if at is not None]
        ax.scatter(parted, [row] * len(parted), color="#c0392b", s=22, zorder=3,
                   label="parts from the baseline here (one prompt)" if row == 0 else None)
        same = len(ran) - len(parted)
        if same:
            ax.scatter([longest], [row], facecolor="white", edgecolor="#2e7d32", s=40, zorder=3)
            ax.annotate(f"{same}× same to the end", (longest, row), xytext=(6, -3), textcoords="offset points", fontsize=7)
        if not ran:
            ax.text(1, row, "no generation recorded (" + ", ".join(sorted({r.results.status for r in runs})) + ")",
                    va="center", fontsize=7, color="#666666")
    if decisive_output_token is not None:
        ax.axvline(decisive_output_token, color="black", linestyle="--", linewidth=0.8, label="designed decision")
    ax.set_yticks(range(len(configs)), list(configs), fontsize=8)
    ax.set_ylim(len(configs) - 0.5, -0.5)
    ax.set_xlim(0, longest * 1.25)
    ax.set_xlabel(f"output token where the configuration first parts from {baseline} (hollow: never, through "
                  f"{longest} tokens)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a dot
    fig.tight_layout()
    plt.close(fig)
    return fig


def seeds_text(records: list[Record], baseline: str | None, decisive_output_token: int | None) -> str:
    """The across-prompts finding in words: how many speculative configurations part from the baseline
    on how many prompts, where (against the designed decision, if the model has one: None for random
    weights), whether any stop moved, and how the configurations without speculation fared."""
    methods = {r.parameters.configuration: r.parameters.method for r in records}
    rows = [r for r in seeds_rows(records, baseline) if r["configuration"] != baseline and r["prompts"]]
    plain_rows = [r for r in rows if methods.get(r["configuration"]) == "none"]
    rows = [r for r in rows if methods.get(r["configuration"]) != "none"]
    seeds = sorted({prompt_seed(r) for r in records})
    if not rows:
        text = f"no speculative configuration ran on the {len(seeds)} prompt{'s' if len(seeds) != 1 else ''}"
    else:
        parted = [r for r in rows if not r["parts from the baseline"].startswith("0/")]
        where = sorted({int(p) for r in parted for p in r["where (output token)"].split(", ")})
        moved = [r for r in rows if r["stop moved"] != "never"]
        text = (f"{len(rows)} speculative configuration{'s' if len(rows) != 1 else ''} ran on {len(seeds)} "
                f"prompt{'s' if len(seeds) != 1 else ''}; "
                f"{len(parted)} of them wrote something other than {baseline} on at least one prompt")
        if where:
            text += f", first parting at output token{'s' if len(where) > 1 else ''} {', '.join(map(str, where))}"
            if decisive_output_token is not None:
                at_decision = decisive_output_token in where
                text += (f" ({'including' if at_decision else 'never at'} the designed decision, output token "
                         f"{decisive_output_token})")
        text += "; " + (f"the stop moved for {len(moved)} of them "
                        f"({'; '.join(r['configuration'] + ': ' + r['stop moved'] for r in moved)})"
                        if moved else f"no configuration stopped anywhere other than where {baseline} did")
    for r in plain_rows:
        where = r["where (output token)"]
        text += (f"; without speculation, {r['configuration']} parts from {baseline} on {r['parts from the baseline']}"
                 f" prompts" + (f" (first at output token{'s' if ',' in where else ''} {where})" if where != "—" else ""))
    return text


def by_run(records: list[Record]) -> dict[str, list[Record]]:
    """Measured runs grouped by where they came from (environment, vLLM build, hardware, model)."""
    groups: dict[str, list[Record]] = {}
    for r in measured_runs(records):
        groups.setdefault(run_label(r), []).append(r)
    return groups


def run_summary(records: list[Record], decisive_output_token: int, pieces) -> str:
    """One host's recorded run in words: configurations grouped by status (with the generations recorded of
    those asked for), the engines' own errors, prompts, what the incident's prompt got at the designed
    decision, and across prompts."""
    configs: dict[str, list[Record]] = {}
    for r in records:
        configs.setdefault(r.parameters.configuration, []).append(r)
    groups: dict[str, list[str]] = {}
    partial = False  # some configuration recorded fewer generations than asked
    for name, runs in configs.items():
        recorded = sum(r.results.runs_total for r in runs)
        asked = sum(r.parameters.repeats for r in runs)
        statuses = ", ".join(sorted({r.results.status for r in runs}))
        partial = partial or recorded != asked
        groups.setdefault(statuses, []).append(name if recorded == asked else f"{name} ({recorded} of {asked})")
    causes: dict[str, tuple[str, list[str]]] = {}  # kind of error (numbers aside) -> its first text, configurations
    for name, runs in configs.items():
        for error in (r.results.error for r in runs if r.results.error):
            cause = root_cause(error) or f"{error['type']}: {error['message'][-200:]}"
            _, names = causes.setdefault(re.sub(r"\d+(?:\.\d+)?", "#", cause), (cause, []))
            if name not in names:
                names.append(name)
    baseline = records[0].parameters.baseline
    seeds = sorted({prompt_seed(r) for r in records})
    text = (f"{len(configs)} configuration{'s' if len(configs) != 1 else ''} recorded on {len(seeds)} "
            f"prompt{'s' if len(seeds) != 1 else ''} (seeds {', '.join(map(str, seeds))}). "
            + " ".join(f"{status.capitalize()}: {', '.join(names)}." for status, names in groups.items()))
    if partial:
        text += " (A name with a count recorded only that many of its generations.)"
    unexpected = [f"{name} (expected {runs[0].results.expected})" for name, runs in configs.items()
                  if any(r.results.as_expected is False and r.results.status != "interrupted"
                         for r in runs)]  # an interrupted run is unfinished, not a surprise
    if unexpected:
        text += f" Not as the matrix expected: {', '.join(unexpected)}."
    for cause, names in causes.values():
        text += f" The engine's own error of {', '.join(names)}: \"{cause}\"."
    if qwen_shapes.is_random_weight_run(records[0]):
        asked = sorted({r.parameters.max_tokens for r in records})
        text += (" Random weights: the prompt's designed decision means nothing to this model, and every "
                 "generation was asked for " + " or ".join(map(str, asked)) + " tokens"
                 + (" whatever the model wrote (ignore_eos)" if all(r.parameters.ignore_eos for r in records)
                    else "") + ".")
        return f"{text} Across prompts: {seeds_text(records, baseline, None)}."
    return (f"{text} At the designed decision (output token {decisive_output_token}) of the first prompt: "
            f"{decision_text(first_prompt(records), decisive_output_token, pieces)}. Across prompts: "
            f"{seeds_text(records, baseline, decisive_output_token)}.")


def one_run(records: list[Record], environment: str) -> list[Record]:
    """The runs of one matrix run in `environment`, on its first prompt: this host's if it made any (what
    the build just ran), else those of a host of identical hardware (what the build reused), else the first
    recorded host's; of a host's runs, the unsplit one with the most repeats
    (the build's). Runs of several hosts, prompts or splits are never mixed."""
    from spectie.records.store import standing_first

    mine = standing_first([r for r in records if r.environment == environment], environment)
    mine = [r for r in mine if r.fingerprint.host_id == mine[0].fingerprint.host_id]
    runs: dict[RunKey, list[Record]] = {}
    for r in mine:
        runs.setdefault(run_key(r), []).append(r)
    if not runs:
        return []
    key = min(runs, key=lambda k: (k.ranks, -max(r.parameters.repeats or 0 for r in runs[k]), k.prompts))
    return first_prompt(runs[key])


def prose_values() -> dict:
    """Figures the chapter's prose names, from the code and the weights that make them."""
    from collections import Counter

    from transformers import AutoConfig

    from spectie.lab.model import resolve_model
    from spectie.lab.prompts import PromptSpec

    config = AutoConfig.from_pretrained(resolve_model("organism"))
    layers = Counter(getattr(config, "text_config", config).layer_types)
    attention = layers["full_attention"]
    return {"organism_layers": f"{layers['linear_attention']} Gated DeltaNet layers and {attention} attention layer"
                               + ("s" if attention != 1 else ""),
            "context_tokens": CONTEXT_TOKENS, "incident_seed": PromptSpec(tokens=1845).seed,
            "shape_logit_std": sweeps.DEFAULT_LOGIT_STD}


def differ_text(records: list[Record]) -> str:
    """'mtp-k3: 55, 96 tokens, first divergence at output token 12; ...' for each configuration whose repeats part
    from the baseline's; 'none'."""
    return "; ".join(
        f"{r.parameters.configuration}: {', '.join(sorted({str(x['output_tokens']) for x in r.results.repeats}))}"
        f" tokens, first divergence at output token "
        f"{1 + min(x['first_divergence'] for x in r.results.repeats if x['first_divergence'] is not None)}"
        for r in records) or "none"


def run_values(plan, records: list[Record], all_records: list[Record]) -> dict:
    """The glue values of this run (spectie.engines.plan.Plan): what ran, failed and differed on the first prompt's
    `records`, the baseline's ending, the designed decision, and across all prompts (`all_records`)."""
    from spectie.lab.tokenizer import model_tokenizer

    matrix, decision = plan.matrix, plan.prompt.decisive_output_token
    base = next((r.results for r in records if r.parameters.configuration == matrix.baseline), None)
    first = base.repeats[0] if base and base.repeats else None
    ran = [r for r in records if r.results.status == "ok"]
    failed = [r for r in records if r.results.status != "ok"]
    speculative = [r for r in ran if r.parameters.method != "none"]
    # Parted: a repeat compared with the baseline and not the same (where no baseline ran, none is compared).
    differ = [r for r in speculative if any(x["same_as_baseline"] is False for x in r.results.repeats)]
    return {
        "vllm_version": plan.probe["vllm_version"], "vllm_platform": plan.probe["platform"], "model": plan.model_label,
        "prompt_len": len(plan.prompt.token_ids), "n_configurations": len(records), "n_ran": len(ran),
        "n_failed": len(failed), "failed_list": ", ".join(
            f"{r.parameters.configuration} ({r.results.status})" for r in failed) or "none",
        "baseline_tokens": first["output_tokens"] if first else "—",
        "baseline_finish": first["finish_reason"] if first else "—",
        "baseline_stopped": f"{base.runs_stopped}/{base.runs_total}" if base else "—",
        "n_speculative": len(speculative), "n_differ": len(differ), "differ_list": differ_text(differ),
        "decision_output_token": decision, "parting_text": parting_text(records, matrix.baseline, decision),
        "decision_text": decision_text(records, decision, model_tokenizer(plan.model_path).convert_ids_to_tokens),
        "all_repeats_identical": "yes" if all(r.results.distinct_outputs == 1 for r in ran) else "no",
        "n_seeds": len(plan.seeds), "seeds_text": seeds_text(all_records, matrix.baseline, decision)}


def other_runs(measured: list[Record], this_build: set[str], decisive_output_token: int, pieces) -> list:
    """What the page shows for every other host's recorded run of this chapter: its summary in words, its table
    across prompts (folded) and its dot plot of where each configuration parts from plain greedy."""
    from IPython.display import Markdown

    from spectie.book import pages
    from spectie.records.store import provenance_line

    shown = []
    for label, runs in by_run([r for r in measured if r.id not in this_build]).items():
        baseline, prompts = runs[0].parameters.baseline, len({prompt_seed(r) for r in runs})
        decision = None if qwen_shapes.is_random_weight_run(runs[0]) else decisive_output_token
        figure = parting_plot(runs, baseline, decision,
                              "where each configuration first parts from the baseline, one dot per prompt")
        shown += [Markdown(f"**{label}.** " + run_summary(runs, decisive_output_token, pieces)),
                  pages.folded(pd.DataFrame(seeds_rows(runs, baseline)).style.hide(axis="index"),
                               f"Per configuration, across the {prompts} prompts (table)"),
                  pages.captioned(figure, f"Dot plot — for {label}, the output token where each configuration first "
                                  "parts from plain greedy, one dot per prompt", f"{label}: where each configuration "
                                  "first parts from plain greedy, one dot per prompt (hollow: the same tokens to the "
                                  f"end). {provenance_line(runs)}")]
    return shown or [Markdown("No other host's run of this chapter is recorded.")]
