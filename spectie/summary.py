"""The book's answer (its first page), computed from the records: the verdict, how strong its evidence is,
what was not measured, and what an operator should check.

Every sentence here is built from records, so the answer changes when the records do: a reference in
which fp32 and bf16 agree, a plain-greedy run that goes on, or an engine divergence outside the noise band
turns the verdict or its strength, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spectie.bands import bf16_order_text
from spectie.claims import commit_claim
from spectie.divergence_verdicts import blind_spot
from spectie.environments import gpu_releases, incident_releases
from spectie.pages import and_list, bullets, capitalised
from spectie.record_types import Record
from spectie.thresholds import REFERENCE_ID, Reference, reference

NEAR_TIE = "a numerical near-tie, not a speculative-decoding correctness bug"
NOT_SETTLED = "not settled by these records"
STRONG, MODERATE, WEAK = "strong", "moderate", "weak"
PLAIN_ID = "b200-plain-greedy"  # the incident's plain-greedy run on B200


@dataclass
class Verdict:
    answer: str
    strength: str
    why_strength: str
    because: list[str] = field(default_factory=list)  # the evidence for the answer, each with its origin
    caveats: list[str] = field(default_factory=list)  # what the records say against it, or beside it
    not_measured: list[str] = field(default_factory=list)
    tie_note: str = ""  # why the incident's margin counts as a tie beside the much narrower bands measured here


def flip_curves(records: list[Record]) -> list[dict]:
    """Per measured flip-curve record (margins chapter): on which device, how many decisions, how many bf16
    flipped against the fp64 reference, and the largest reference margin at which one flipped."""
    rows = []
    for record in records:
        if record.kind != "flip-curve" or not record.measured:
            continue
        pairs = record.results.pairs
        flipped = [margin for margin, flip in pairs if flip]
        rows.append({"record": record.id, "device": record.device,
                     "model": record.parameters.model, "decisions": len(pairs), "flips": len(flipped),
                     "largest_flipped": max(flipped, default=None), "reference": record.results.reference})
    return rows


def engine_divergences(records: list[Record]) -> list[dict]:
    """Per divergence-verdicts record and speculative method: the vLLM outputs that parted from plain greedy,
    how many the classifier called near-ties, and the fp32 margins of the others."""
    from spectie import divergence
    from spectie.divergence_verdicts import VERDICTS_KIND

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
                         "threshold": parameters.threshold, "divergences": len(mine),
                         "near_ties": len(mine) - len(outside), "outside": sorted(outside)})
    return rows


def trained_qwen_references(records: list[Record]) -> list[Reference]:
    """Measured references of a trained Qwen3.5 model (not the organism, not a random-weight shape)."""
    found = []
    for record in records:
        model = str(record.parameters.model or "") if record.kind == "logit-comparison" else ""
        if (record.measured and record.kind == "logit-comparison"
                and "qwen3.5" in model.lower() and "shape" not in model.lower()):
            found.append(reference(record))
    return found


def unmeasured_environments(records: list[Record], environments: dict[str, dict]) -> list[str]:
    """The incident's environments that no measured record of this book ran in."""
    measured = {env for r in records if r.measured for env in r.environments}
    return [env_id for env_id, env in sorted(environments.items())
            if env["named_in_incident"] and env_id not in measured]


def _number(value: float) -> str:
    return f"{value:.2f}"


def reference_sentence(ref: Reference) -> str:
    first, second = ref.tokens
    winner = {True: first, False: second}
    relation = "more than" if ref.swing > abs(ref.fp32) else "no more than"
    where = f" at position {ref.position}" if ref.position is not None else ""
    return (f"the incident's own transformers references{where} give {winner[ref.fp32 > 0]} the lead by "
            f"{_number(abs(ref.fp32))} logits in fp32 and {winner[ref.bf16 > 0]} by {_number(abs(ref.bf16))} in "
            f"bf16: precision alone moved the margin by {_number(ref.swing)} logits, {relation} the margin itself "
            f"(reported, record `{ref.record_id}`)")


def tie_note(ref: Reference, bands: list[float]) -> str:
    """Why a margin of the incident's size is a tie on the real model, although the bands measured here (the
    classifier's, on the organism) are far narrower: the incident's own references, reported."""
    if not ref.flipped:
        return ""
    span = _number(min(bands)) if bands and min(bands) == max(bands) else (
        f"{_number(min(bands))} to {_number(max(bands))}" if bands else "")
    here = (f"the thresholds the classifier used here ({span} logits) are the organism's, a tiny model's, and say "
            "nothing of Qwen3.5's own; " if bands else "")
    return (f"Why a margin of {_number(abs(ref.fp32))} logits counts as a tie: {here}on the real model, the incident's "
            f"own references show bf16 moving this very margin by {_number(ref.swing)} logits (reported, record "
            f"{ref.record_id}), so a margin of {_number(abs(ref.fp32))} is inside what precision alone moves.")


def flip_sentence(curve: dict) -> str:
    if not curve["flips"]:
        return (f"on the organism ({curve['device']}), bf16 kept the {curve['reference']} reference's token at all "
                f"{curve['decisions']} decisions measured (measured, record `{curve['record']}`)")
    return (f"on the organism ({curve['device']}), bf16 took another token than the {curve['reference']} reference "
            f"at {curve['flips']} of {curve['decisions']} decisions, every one with a reference margin of at most "
            f"{curve['largest_flipped']:.3f} logits (measured, record `{curve['record']}`)")


def divergence_sentence(row: dict) -> str:
    where = row["device"] if row["device"].lower() == row["environment"].lower() else f"{row['device']}, {row['environment']}"
    head = (f"speculation by {row['method']} through vLLM {row['vllm']} ({where}) on "
            f"the {row['model']}: ")
    if not row["outside"]:
        which = ("its one divergence from plain greedy is a near-tie" if row["divergences"] == 1 else
                 f"all {row['divergences']} of its divergences from plain greedy are near-ties")
        return head + f"{which}, inside the noise band of {row['threshold']:.3f} logits (measured)"
    worst = max(abs(margin) for margin in row["outside"])
    return (head + f"{len(row['outside'])} of its {row['divergences']} divergences from plain greedy write tokens "
            f"that trail the fp32 reference's choice by more than the noise band of {row['threshold']:.3f} logits "
            f"(up to {worst:.1f} logits at the token where they part): a suspected correctness bug, not a near-tie "
            "(measured)")


def verdict(records: list[Record], environments: dict[str, dict]) -> Verdict:
    """The answer to "is it a bug?", from the records.

    A near-tie needs the incident's references to disagree on the winner (precision alone moves the margin
    by more than the margin). Its evidence is strong only when a trained Qwen3.5 model measured here shows
    the same; moderate when the reported plain-greedy run stops too and this project saw speculation through
    real vLLM take the other side of near-ties without leaving the band; weak otherwise.
    """
    by_id = {r.id: r for r in records}
    ref = reference(by_id[REFERENCE_ID]) if REFERENCE_ID in by_id else None
    plain = by_id.get(PLAIN_ID)
    plain_stops = bool(plain and plain.results.stopped_early and plain.results.same_position_as)
    curves = flip_curves(records)
    divergences = engine_divergences(records)
    mechanism = [row for row in divergences if row["divergences"] and row["near_ties"]]
    measured_qwen = trained_qwen_references(records)
    trained = [r for r in measured_qwen if r.flipped]

    result = Verdict(answer=NEAR_TIE if ref is not None and ref.flipped else NOT_SETTLED, strength=WEAK,
                     why_strength="")
    if ref is not None:
        result.because.append(reference_sentence(ref))
    else:
        result.because.append("no record holds the incident's fp32 and bf16 references at the stop")
    if plain is not None:
        result.because.append("plain greedy decoding without speculation stops at the same position on B200: the "
                              "stop is not speculation's own (reported, record `b200-plain-greedy`)" if plain_stops
                              else "the reported plain-greedy run does not stop at the same position "
                                   "(reported, record `b200-plain-greedy`)")
    result.because += [flip_sentence(curve) for curve in curves]
    # One line per engine environment, however many hosts' verdict records classified its divergences alike.
    result.because += dict.fromkeys(divergence_sentence(row) for row in mechanism if not row["outside"])
    result.caveats += dict.fromkeys(divergence_sentence(row) for row in divergences if row["outside"])
    result.caveats += [said for said in [blind_spot(records)] if said]  # what a near-tie verdict cannot rule out

    result.tie_note = tie_note(ref, [row["threshold"] for row in divergences]) if ref is not None else ""
    order = bf16_order_text(abs(ref.fp32), records) if result.tie_note else ""
    result.tie_note += f" {order}." if order else ""  # bf16 against bf16, beside the fp32-against-bf16 swing
    result.strength, result.why_strength = _strength(result.answer, bool(trained), plain_stops, bool(mechanism),
                                                     ref is not None and ref.flipped)
    result.not_measured = _not_measured(records, environments, bool(measured_qwen))
    return result


def _strength(answer: str, trained: bool, plain_stops: bool, mechanism: bool, flipped: bool) -> tuple[str, str]:
    """How strong the verdict's evidence is, and why (see `verdict`)."""
    if answer == NEAR_TIE and trained:
        return STRONG, "a trained Qwen3.5 model measured here shows the fp32 and bf16 winners disagree"
    if answer == NEAR_TIE and plain_stops and mechanism:
        return MODERATE, ("the near-tie is the incident's own reported measurement on the real model, and plain "
                          "greedy stops there too (reported); this project reproduced the mechanism — speculation "
                          "taking the other side of a near-tie through real vLLM, inside the noise band — on a tiny "
                          "model only")
    return WEAK, "the records lack " + ", ".join(
        need for need, have in (("references that disagree on the winner", flipped),
                                ("a plain-greedy stop at the same position", plain_stops),
                                ("a measured speculative near-tie through vLLM", mechanism)) if not have)


def _not_measured(records: list[Record], environments: dict[str, dict], measured_qwen: bool) -> list[str]:
    """What the records do not hold: a trained Qwen3.5 run, the incident's environments and releases, spreads."""
    said = []
    if not measured_qwen:
        said.append("no trained Qwen3.5 model was run for this report: every Qwen3.5 figure is the incident's, "
                    "reported")
    missing = unmeasured_environments(records, environments)
    if missing:
        said.append("the incident's environments were not run here: " + ", ".join(
            f"{environments[e]['title']}" for e in missing))
    ran = gpu_releases(records)
    unrun = [v for v in incident_releases(environments) if v not in ran]
    if unrun:
        said.append(f"the incident's vLLM release{'s' if len(unrun) > 1 else ''} {' and '.join(unrun)} did not run "
                    "here on a GPU" + (f" (the GPU runs here are of vLLM {' and '.join(ran)}, measured)" if ran else ""))
    said.append(spread_sentence(records))
    return said


SPREAD_SHAPE = "qwen3.5-9b-shape"


def spread_sentence(records: list[Record]) -> str:
    """Why the random-weight shapes are not evidence: how far one shape's band of the order of sums moves
    with the logit spread of its weights, from its records."""
    from spectie.bands import band_points, spread_points

    sweeps = [r for r in records if r.kind == "reduction-sweep"]
    points = sorted(spread_points(band_points(sweeps), SPREAD_SHAPE), key=lambda p: p["logit_std"])
    head = "random-weight Qwen3.5 shapes are not evidence for the verdict: their bands scale with the logit spread "
    if len(points) < 2:
        return head + "chosen for random weights (one spread recorded, so how far is not measured)"
    low, high = points[0], points[-1]
    return head + (f"chosen for random weights ({SPREAD_SHAPE}, bf16: the order of sums alone moves a margin by "
                   f"{low['order']:.2f} logits at spread {low['logit_std']:g} and {high['order']:.2f} at spread "
                   f"{high['logit_std']:g}, measured)")


def gpu_matrix_runs(records: list[Record]) -> dict[tuple[str, str], list[Record]]:
    """The measured reproduce-matrix records of trained weights (not a random-weight shape) run through vLLM on a
    GPU, per environment and model, ordered by vLLM release."""
    from spectie.fixes import _version_key
    from spectie.qwen_shapes import is_random_weight_run

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
    from spectie.completions import stopped_earlier, tokens_before_stop

    baselines = {r.parameters.prompt_seed: r.results.repeats[0] for r in runs
                 if r.parameters.configuration == r.parameters.baseline and r.results.repeats}
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
    from spectie.fixes import pull_requests_text

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
    from spectie.environments import load_environments, release
    from spectie.fixes import pull_requests_text

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
    from spectie.environments import release

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
    from spectie.fixes import pull_requests_text

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


def page_values(records: list[Record], environments: dict[str, dict], ledger: Record) -> dict:
    """The first page's glue values: the first report's stop, the verdict with its strength, reasons, caveats and
    what was not measured, the GPU findings, the ngram advice, and how many records say it."""
    from IPython.display import Markdown

    first = next(r for r in records if r.id == "original-mtp-wide-verify")
    first_report = first.results
    answer = verdict(records, environments)
    return {
        "reported_tokens": first_report.output_tokens_before_stop, "reported_tail": first_report.tail_text,
        "reported_path": {"mtp": "MTP"}.get(first.parameters.method, first.parameters.method),
        "answer": answer.answer, "strength": answer.strength, "why_strength": answer.why_strength,
        "tie_note": answer.tie_note, "because": Markdown(bullets(answer.because)),
        "caveats": Markdown(bullets(answer.caveats or ["none in these records"])),
        "not_measured": Markdown(bullets(answer.not_measured)),
        "gpu_findings": Markdown(gpu_findings_markdown(records, ledger) or "- No vLLM run on a GPU is recorded."),
        "ngram_advice": "; ".join(filter(None, [ngram_advice(records, ledger), incident_ngram_text(records, ledger)])),
        "record_count": len(records), "measured_count": sum(r.measured for r in records),
        "commit_text": commit_claim(records)}
