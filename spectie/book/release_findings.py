"""The reproduce matrix's GPU runs per release, in words: which speculative configurations stopped earlier than plain
greedy, how the classifier judged their divergences, and what the fix ledger says of each release; and the advice
on ngram_gpu that follows from them. Computed from the records (the first page's "Per release, in words").
"""

from __future__ import annotations

from spectie.book.pages import and_list, capitalised
from spectie.records.record_types import Record


def engine_divergences(records: list[Record]) -> list[dict]:
    """Per divergence-verdicts record and speculative method: the vLLM outputs that parted from plain greedy,
    how many the classifier called near-ties, and the fp32 margins of the others."""
    from spectie.tools import divergence
    from spectie.tools.divergence_verdicts import VERDICTS_KIND

    rows = []
    for record in records:
        if record.kind != VERDICTS_KIND:
            continue
        parameters = record.parameters
        for method in sorted({row["class"] for row in record.results.rows}):
            mine = [row for row in record.results.rows if row["class"] == method]
            outside = [row["fp32_margin"] for row in mine if row["verdict"] != divergence.Verdict.NEAR_TIE.label]
            rows.append({"environment": parameters.engine_environment, "vllm": parameters.engine_vllm,
                         "device": parameters.engine_device, "model": parameters.model, "method": method,
                         "host": record.fingerprint.host_id if parameters.engine_environment == "cpu" else "",
                         "threshold": parameters.threshold, "divergences": len(mine),
                         "near_ties": len(mine) - len(outside), "outside": sorted(outside)})
    return rows


def gpu_matrix_runs(records: list[Record]) -> dict[tuple[str, str], list[Record]]:
    """The measured reproduce-matrix records of trained weights (not a random-weight shape) run through vLLM on a
    GPU, per environment and model, ordered by vLLM release."""
    from spectie.tools.fixes import _version_key
    from spectie.lab.qwen_shapes import is_random_weight_run

    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        if (r.measured and r.kind == "engine-outcome" and r.chapter == "reproduce"
                and r.fingerprint.gpu and not is_random_weight_run(r)):
            groups.setdefault((r.environment, str(r.parameters.model)), []).append(r)
    return dict(sorted(groups.items(), key=lambda item: (_version_key(item[1][0].fingerprint.vllm), item[0])))


def _k_list(records: list[Record]) -> str:
    ks = sorted({r.parameters.num_speculative_tokens for r in records})
    return f"K = {', '.join(map(str, ks))}"


def early_stops(runs: list[Record], method: str) -> tuple[list[str], list[str]]:
    """For one environment's matrix: the configurations of `method` that stopped earlier than the baseline on
    some prompt (with prompt seed, repeats and tokens written, in words), and those that never did."""
    from spectie.records.completions import stopped_earlier, tokens_before_stop

    baselines = {r.parameters.prompt_seed: r.results.repeats[0] for r in runs
                 if r.is_baseline and r.results.repeats}
    stopped, never = {}, []
    for name in sorted({r.parameters.configuration for r in runs if r.parameters.method == method}):
        for r in sorted((r for r in runs if r.parameters.configuration == name),
                        key=lambda r: r.parameters.prompt_seed):
            seed, repeats = r.parameters.prompt_seed, r.results.repeats
            early = [x for x in repeats if seed in baselines and stopped_earlier(x, baselines[seed])]
            if early:
                written = sorted({tokens_before_stop(x) for x in early})
                tails = sorted({x["tail_text"].rsplit(chr(10), 1)[-1] for x in early})
                margins = sorted({x["stop_margin"]["margin"] for x in early if x.get("stop_margin")})
                stopped.setdefault(name, []).append(
                    f"prompt seed {seed}: {len(early)} of {len(repeats)} repeats, after "
                    f"{' or '.join(map(str, written))} output tokens, right after "
                    + " or ".join(f"`{tail}`" for tail in tails)
                    + (f", the stop token ahead by {' or '.join(f'{m:g}' for m in margins)} logits in vLLM's "
                       "own logprobs" if margins else ""))
        if name not in stopped:
            never.append(name)
    return [f"{name} ({'; '.join(parts)})" for name, parts in stopped.items()], never


def _verdicts_clause(row: dict | None, parted: bool) -> str:
    """How the classifier's verdict record calls one method's divergences in one environment, as a clause."""
    if row and row["outside"]:
        return (f"; the classifier calls {len(row['outside'])} of its {row['divergences']} divergences (first "
                f"repeats, one per prompt and position) suspected correctness bugs, up to "
                f"{max(abs(m) for m in row['outside']):.1f} logits apart in fp32, outside the noise band of "
                f"{row['threshold']:.3f}")
    if row:
        return (f"; the classifier calls all {row['divergences']} of its divergences (first repeats, one per prompt "
                f"and position) near-ties, inside the noise band of {row['threshold']:.3f}")
    return "; its divergences are not classified yet" if parted else ""


def gpu_findings(records: list[Record], ledger: Record | None = None) -> list[str]:
    """Per vLLM release run on a GPU here, one sentence (`gpu_finding_parts` joined)."""
    return [head + ": " + "; ".join(parts) for head, parts in gpu_finding_parts(records, ledger)]


def gpu_findings_markdown(records: list[Record], ledger: Record | None = None) -> str:
    """`gpu_finding_parts` as a Markdown list: a release per item, what each path did beneath it."""
    return "\n".join(f"- **{head}**:\n" + "\n".join(f"  - {capitalised(part)}." for part in parts)
                     for head, parts in gpu_finding_parts(records, ledger))


def gpu_finding_parts(records: list[Record], ledger: Record | None = None) -> list[tuple[str, list[str]]]:
    """Per vLLM release run on a GPU here (the reproduce matrix on the organism): whether MTP stopped earlier
    than plain greedy and with which configurations, whether ngram_gpu parted from plain greedy and how the
    classifier's verdict records call those divergences, and which #39273 fixes the ledger finds in that
    release. Each covers one environment's records, all of its prompts: (where it ran, [one clause a path])."""
    from spectie.tools.fixes import pull_requests_text

    divergences = {(row["environment"], row["method"]): row for row in engine_divergences(records)}
    lines = []
    for (env_id, model), runs in gpu_matrix_runs(records).items():
        first = runs[0].fingerprint
        seeds = sorted({r.parameters.prompt_seed for r in runs})
        head = (f"vLLM {first.vllm} on an {first.gpu} ({env_id}, the {model}, {len(seeds)} "
                f"prompt{'s' if len(seeds) != 1 else ''}, measured)")
        mtp = [r for r in runs if r.parameters.method == "mtp"]
        if mtp:
            stopped, never = early_stops(runs, "mtp")
            if stopped:
                text = f"MTP stopped earlier than plain greedy in {and_list(stopped)}"
                text += f", and never in {', '.join(never)}" if never else ""
            else:
                text = f"MTP ({_k_list(mtp)}) never stopped earlier than plain greedy"
            parted = any(not x.get("same_as_baseline") for r in mtp for x in r.results.repeats)
            parts = [text + _verdicts_clause(divergences.get((env_id, "mtp")), parted)]
        else:
            parts = ["MTP did not run"]
        ngram = [r for r in runs if r.parameters.method == "ngram_gpu" and r.results.repeats]
        if ngram:
            generations = [x for r in ngram for x in r.results.repeats]
            parted = sum(not x.get("same_as_baseline") for x in generations)
            text = (f"ngram_gpu ({_k_list(ngram)}) wrote plain greedy's tokens in {len(generations) - parted} of "
                    f"{len(generations)} generations")
            parts.append(text + _verdicts_clause(divergences.get((env_id, "ngram_gpu")), bool(parted)))
        if ledger is not None:
            parts.append("the fix ledger's pull requests for #39273 (GDN state under speculation) in this release: "
                         + pull_requests_text(ledger, first.vllm))
        lines.append((head, parts))
    return lines


def incident_ngram_text(records: list[Record], ledger: Record) -> str:
    """The incident's own ngram_gpu stops (reported) against the #39273 fixes the ledger finds in their release."""
    from spectie.records.environments import load_environments, release
    from spectie.tools.fixes import pull_requests_text

    environments = load_environments()
    parts = []
    for r in records:
        if r.provenance != "reported" or r.kind != "engine-outcome" or r.parameters.method != "ngram_gpu":
            continue
        for version in sorted({release(environments[e]["vllm"]["version"]) for e in r.environments
                               if e in environments and environments[e]["vllm"].get("version")}):
            parts.append(f"the incident's own ngram_gpu {'stop' if r.results.stopped_early else 'run'} "
                         f"(reported, record {r.id}) ran vLLM {version}, whose wheel the fix ledger reads as: "
                         + pull_requests_text(ledger, version)
                         + same_release_ngram(records, version)
                         + ": it may be this correctness bug rather than a tie, and these records cannot tell which")
    return "; ".join(parts)


def same_release_ngram(records: list[Record], version: str) -> str:
    """What ngram_gpu did on the organism through the same vLLM release on a GPU here (classified divergences),
    as a clause; empty where that release did not run ngram_gpu here."""
    from spectie.records.environments import release

    said = []
    for row in engine_divergences(records):
        if row["method"] != "ngram_gpu" or release(row["vllm"]) != version or row["device"] == "CPU":
            continue
        if row["outside"]:
            said.append(f"; on the organism, ngram_gpu of that release ({row['environment']}, measured) wrote tokens "
                        f"outside the noise band: the classifier calls {len(row['outside'])} of its {row['divergences']} "
                        "divergences suspected correctness bugs, so the bug is in that release")
        else:
            said.append(f"; on the organism, that release's ngram_gpu ({row['environment']}, measured) parted from "
                        f"plain greedy only at near-ties ({row['near_ties']} of {row['divergences']})")
    clean = [env for (env, _), runs in gpu_matrix_runs(records).items()
             if release(runs[0].fingerprint.vllm) == version and not any(
                 row["environment"] == env and row["method"] == "ngram_gpu" for row in engine_divergences(records))
             and [x for r in runs if r.parameters.method == "ngram_gpu" for x in r.results.repeats]
             and all(x.get("same_as_baseline") for r in runs if r.parameters.method == "ngram_gpu"
                     for x in r.results.repeats)]
    said += [f"; on the organism, that release's ngram_gpu ({env}, measured) wrote plain greedy's tokens every time"
             for env in clean]
    return "".join(dict.fromkeys(said))  # one clause per environment, however many hosts classified its runs


def ngram_advice(records: list[Record], ledger: Record | None = None) -> str:
    """What the records tell an operator of ngram_gpu on a hybrid model, per release run on a GPU; for a release
    where it wrote plain greedy's tokens, what the fix ledger leaves open there."""
    from spectie.tools.fixes import pull_requests_text

    bad, clean, versions = [], [], []
    divergences = {(row["environment"], row["method"]): row for row in engine_divergences(records)}
    for (env_id, _), runs in gpu_matrix_runs(records).items():
        ngram = [x for r in runs if r.parameters.method == "ngram_gpu" for x in r.results.repeats]
        if not ngram:
            continue
        label = f"{runs[0].fingerprint.vllm} ({runs[0].fingerprint.gpu})"
        row = divergences.get((env_id, "ngram_gpu"))
        if row and row["outside"]:
            bad.append(label)
        elif all(x.get("same_as_baseline") for x in ngram):
            clean.append(label)
            versions.append(runs[0].fingerprint.vllm)
    if not bad and not clean:
        return "no GPU run of ngram_gpu is recorded here"
    text = ""
    if bad:
        text += (f"on vLLM {' and '.join(bad)} ngram_gpu wrote tokens outside the noise band (suspected "
                 "correctness bug, measured on the organism)")
    if clean:
        text += ("; " if text else "") + f"on vLLM {' and '.join(clean)} it wrote plain greedy's tokens every time"
        if ledger is not None:
            text += (" (on the organism's prompts: not a proof that the state bug is gone; the fix ledger reads "
                     + "; ".join(f"{v} as {pull_requests_text(ledger, v)}" for v in versions) + ")")
    return text
