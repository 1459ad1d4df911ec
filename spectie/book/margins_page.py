"""The margins chapter's glue values, from its records (spectie.lab.margins measures and writes them): each function
returns {name: value} for one section of the page (spectie.book.pages.glue_all glues them).

    setup = margins.prepare(...)
    recorded = margins.measure_chapter(setup, ...)        # {"decisive": Record, "scan": ..., "decisions": ..., ...}
    values = margins_page.decisive_values(recorded, setup, prompt_tokens)
"""

from __future__ import annotations

import pandas as pd

from spectie.book import plots
from spectie.lab.margins import SHORT, MarginsSetup, bf16_spacing, decision_text, eos_flip_text
from spectie.records.record_types import Record
from spectie.records.store import provenance_line


def names(setup: MarginsSetup) -> tuple[str, str, tuple[str, str]]:
    """The reference precision's short name, the serving one's, and the watched pair of tokens."""
    return SHORT[setup.dtypes[0]], SHORT[setup.serving_dtype], tuple(setup.watch)


def setup_values(setup: MarginsSetup) -> dict:
    from spectie.lab.organism import pinned_digest
    from spectie.lab.prompts import STOP_PROBABILITY

    _, _, pair = names(setup)
    return {"data_token_id": setup.watch[pair[1]], "organism_digest": pinned_digest(),
            "stop_probability": STOP_PROBABILITY}


def continuation_text(recorded: dict[str, Record], setup: MarginsSetup, prompt) -> str:
    """What greedy decoding in the serving precision wrote after the main prompt, as Markdown."""
    scan = recorded["scan"].results
    ended = {"length": "ran to its token limit", "stop": "stopped on an end-of-text token"}.get(
        scan.finish_reason, scan.finish_reason)
    return (f"{setup.serving_dtype} greedy decoding wrote {len(scan.output_ids)} tokens and {ended}. The end of the "
            f"prompt, then what it wrote:\n\n```text\n…{prompt.text[-60:]}\n```\n\n```text\n"
            f"{setup.tokenizer.decode(scan.output_ids)}\n```")


def decisive_values(recorded: dict[str, Record], setup: MarginsSetup, prompt_tokens: int) -> dict:
    """The decisive position: each precision's logits of the pair there (a table), who wins and by how much, and
    the margin along the whole continuation (a figure)."""
    decisive, scan = recorded["decisive"].results, recorded["scan"].results
    reference, _, pair = names(setup)
    table = pd.DataFrame([{"dtype": row["dtype"], **{f"{t} logit": row["logits"][t] for t in pair},
                           "top-1 of the pair": row["winner"], "wins by": row["margin"]}
                          for row in decisive.rows]).set_index("dtype")
    winners = {row["winner"] for row in decisive.rows}
    return {"decisive_table": table.style.format(precision=4), "prompt_tokens": prompt_tokens,
            "serving_dtype": setup.serving_dtype, "output_tokens": len(scan.output_ids),
            "finish_reason": scan.finish_reason, "decisive_position": decisive.position,
            "decisive_verdict": "disagree" if len(winners) > 1 else "agree",
            "decisive_reference_margin": decisive.rows[0]["margin"], "reference_name": reference,
            "margin_plot": plots.margin_along_continuation(scan.rows, [SHORT[d] for d in setup.dtypes], pair,
                                                           f"{setup.model}: logit({pair[0]}) − logit({pair[1]})")}


def decision_values(recorded: dict[str, Record], setup: MarginsSetup, model: str, prompt_seed: int) -> dict:
    """The designed decision across prompts: its band, the median shift, in words and as a figure."""
    summary = recorded["decisions"].results
    rows = summary.rows
    reference, serving, pair = names(setup)
    return {"decision_count": summary.count, "decision_last_seed": rows[-1]["seed"],
            "decision_output_token": rows[0]["output_token"], "decision_band": summary.band,
            "decision_median_shift": summary.median_shift,
            "decision_text": decision_text(rows, summary, reference, serving, prompt_seed),
            "pair_a": pair[0], "pair_b": pair[1], "decision_first_seed": rows[0]["seed"],
            "decision_plot": plots.designed_decisions(rows, pair, reference, serving, summary.band,
                                                      f"{model}: the designed decision in {len(rows)} prompts"),
            "decision_provenance": provenance_line([recorded["decisions"]])}


def flip_values(recorded: dict[str, Record], setup: MarginsSetup, model: str) -> dict:
    """The flip-versus-margin sweep: how often the serving precision's top-1 differs from the reference's, by the
    reference's margin (a figure and a table), and the end-of-text flips among them (a table)."""
    flips, parameters = recorded["flips"].results, recorded["flips"].parameters
    reference, serving, _ = names(setup)
    pairs, eos_flips = flips.pairs, flips.eos_flips
    columns = ["seed", "position"] + [f"{SHORT[d]}_{k}" for d in setup.dtypes for k in ("top1", "diff")]
    readable = {f"{SHORT[d]}_{k}": f"{SHORT[d]} {name}" for d in setup.dtypes
                for k, name in (("top1", "top-1"), ("diff", "watched difference"))}
    return {
        "sweep_count": parameters.sweep_prompts, "sweep_prompt_tokens": parameters.sweep_prompt_tokens,
        "sweep_new_tokens": parameters.sweep_new_tokens, "serving_name": serving, "n_pairs": len(pairs),
        "n_flips": sum(f for _, f in pairs),
        "flip_plot": plots.flip_rate_vs_margin(flips.bins, reference, serving, f"{model}: {len(pairs)} positions"),
        "flip_table": pd.DataFrame(flips.bins).set_index(["low", "high"]).style
        .format({"flip_rate": "{:.2f}"}, na_rep="—").format_index("{:g}"),
        "n_eos_flips": len(eos_flips),
        "eos_flip_text": eos_flip_text(eos_flips, flips.eos_decision_margins, reference, serving),
        "eos_flip_table": pd.DataFrame(eos_flips, columns=columns).rename(columns=readable)
        .style.format(precision=3).hide(axis="index")}


def incident_values(reported: list[Record]) -> dict:
    """The incident's reported logits on the bf16 grid: margins in bf16 steps (a figure)."""
    from spectie.book.incident import logit_comparison

    incident = logit_comparison(reported)
    rows = {row["dtype"]: row for row in incident.results.rows}
    spacing = bf16_spacing(rows["fp32"]["logits"]["EOS"])
    values = {"spacing_16": spacing, "incident_position": incident.results.position,
              "incident_eos_logit": rows["fp32"]["logits"]["EOS"]}
    for dtype in ("fp32", "bf16"):
        values[f"incident_{dtype}_margin"] = rows[dtype]["margin"]
        values[f"incident_{dtype}_steps"] = rows[dtype]["margin"] / spacing
    grid = {f"{dtype} {token}": value for dtype, row in rows.items() for token, value in row["logits"].items()}
    values["grid_plot"] = plots.bf16_grid(grid, "The incident's logits (reported) on the bf16 grid")
    return values


def recorded_runs_table(records: list[Record]) -> pd.DataFrame:
    """Every recorded measured logit comparison of the chapter: where it ran and who won in each precision."""
    from spectie.lab.bands import model_name

    return pd.DataFrame([{
        "environment": r.environment, "host": r.fingerprint.host_id,
        "GPU": r.fingerprint.gpu or "none (CPU)", "torch": r.fingerprint.torch,
        "transformers": r.fingerprint.transformers, "model": model_name(r),
        "position": r.results.position, "finish": r.results.finish_reason,
        **{f"{row['dtype']} winner (by)": f"{row['winner']} ({row['margin']:.3f})" for row in r.results.rows},
    } for r in records if r.kind == "logit-comparison"])
