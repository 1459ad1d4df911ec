"""The book's answer (its first page), computed from the records: the verdict, how strong its evidence is,
what was not measured, and what an operator should check.

Every sentence here is built from records, so the answer changes when the records do: a reference in
which fp32 and bf16 agree, a plain-greedy run that goes on, or an engine divergence outside the noise band
turns the verdict or its strength, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spectie.lab.bands import bf16_order_text
from spectie.book.claims import Claim, Scope, commit_claim
from spectie.tools.divergence_verdicts import blind_spot
from spectie.records.environments import gpu_releases, incident_releases
from spectie.book.pages import bullets
from spectie.records.record_types import Record
from spectie.book.release_findings import engine_divergences, gpu_findings_markdown, incident_ngram_text, ngram_advice
from spectie.tools.thresholds import REFERENCE_ID, Reference, reference

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
        device = record.device + ("" if record.fingerprint.gpu else f", host {record.fingerprint.host_id}")
        rows.append({"record": record.id, "device": device,  # a CPU's kernels are its host's: said per host
                     "model": record.parameters.model, "decisions": len(pairs), "flips": len(flipped),
                     "largest_flipped": max(flipped, default=None), "reference": record.results.reference})
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
    where += f", host {row['host']}" if row["host"] else ""  # a CPU run is its host's: kernels differ between CPUs
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
    result.because.append(reference_sentence(ref) if ref is not None else
                          "no record holds the incident's fp32 and bf16 references at the stop")
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
    from spectie.lab.bands import band_points, spread_points

    sweeps = [r for r in records if r.kind == "reduction-sweep"]
    points = sorted(spread_points(band_points(sweeps), SPREAD_SHAPE), key=lambda p: p["logit_std"])
    head = "random-weight Qwen3.5 shapes are not evidence for the verdict: their bands scale with the logit spread "
    if len(points) < 2:
        return head + "chosen for random weights (one spread recorded, so how far is not measured)"
    low, high = points[0], points[-1]
    return head + (f"chosen for random weights ({SPREAD_SHAPE}, bf16: the order of sums alone moves a margin by "
                   f"{low['order']:.2f} logits at spread {low['logit_std']:g} and {high['order']:.2f} at spread "
                   f"{high['logit_std']:g}, measured)")


def verdict_part(records: list[Record], part: str):
    """One part of the verdict over `records` (the measure of the first page's claims: "answer", "because", ...)."""
    from spectie.records.environments import load_environments

    return getattr(verdict(records, load_environments()), part)


def findings_lines(records: list[Record], part: str) -> list[str] | str:
    """The first page's per-release findings ("gpu_findings") or ngram_gpu advice ("ngram_advice") over `records`,
    with the committed fix ledger (the measure of those claims)."""
    from spectie.tools.fixes import ledger_record

    ledger = ledger_record()
    if part == "gpu_findings":
        return gpu_findings_markdown(records, ledger) or "- No vLLM run on a GPU is recorded."
    return "; ".join(filter(None, [ngram_advice(records, ledger), incident_ngram_text(records, ledger)]))


def page_values(records: list[Record], environments: dict[str, dict]) -> dict:
    """The first page's glue values: the first report's stop, the verdict with its strength, reasons, caveats and
    what was not measured, the GPU findings and the ngram advice (each a claim over every record: their sentences
    name the records they rest on), and how many records say it."""
    from spectie.tools.fixes import ledger_record, unsettled_text

    first = next(r for r in records if r.id == "original-mtp-wide-verify")
    answer = verdict(records, environments)
    every = Scope("")  # computed over every record, reported and measured
    told = {part: Claim(part, getattr(answer, part), every, "spectie.book.summary:verdict_part", getattr(answer, part),
                        {"part": part}) for part in ("answer", "strength", "why_strength", "tie_note")}
    listed = {part: Claim(part, bullets(getattr(answer, part) or ["none in these records"]), every,
                          "spectie.book.summary:verdict_part", getattr(answer, part), {"part": part}, markdown=True)
              for part in ("because", "caveats", "not_measured")}
    found = {part: Claim(part, text, every, "spectie.book.summary:findings_lines", text, {"part": part},
                         markdown=part == "gpu_findings")
             for part, text in ((p, findings_lines(records, p)) for p in ("gpu_findings", "ngram_advice"))}
    return {"reported_tokens": first.results.output_tokens_before_stop, "reported_tail": first.results.tail_text,
            "reported_path": {"mtp": "MTP"}.get(first.parameters.method, first.parameters.method),
            **told, **listed, **found, "ledger_unsettled": unsettled_text(ledger_record()),
            "record_count": len(records),
            "measured_count": sum(r.measured for r in records), "commit_text": commit_claim(records)}
