"""The bf16 noise bands the reduction-order sweeps recorded (spectie.lab.reduction_order measures them): each sweep's rows
in words, its band per model, precision, kernels and TF32 setting split into the precision and the order of the sums
alone, the widest bf16 band, how bands grow with the model, where the incident's margin falls, and a random-weight
shape's band against the spread of its logits. Read by the tools' thresholds, the guidance chapter and the first page.

    points = band_points(records)        # one per (sweep record, dtype, kernels, TF32)
    widest = largest_bf16_band(points)   # {"label", "band", "precision", "order", ...}
"""

from __future__ import annotations

from spectie.lab.sweeps import BAND_QUANTILE, DEFAULT_LOGIT_STD, LABEL, spread_suffix, weights_of
from spectie.records.record_types import Record


def model_name(record: Record) -> str:
    """The record's model with the digest of its weights where recorded. A record of the organism whose
    digest is not the pinned one was made with another organism (before the organism was pinned, each
    machine trained its own): it is labelled as such, wherever it is shown."""
    from spectie.lab.organism import pinned_digest

    model = record.parameters.model
    digest = record.fingerprint and record.fingerprint.model_sha256
    if model == "organism":
        if not digest:
            return "organism (weights not recorded)"
        if digest == pinned_digest():
            return f"organism ({digest}, pinned)"
        return f"another organism ({digest}, not the pinned one)"
    revision = record.fingerprint and record.fingerprint.model_revision
    name = f"{model}@{revision[:12]}" if revision else model  # a hub id: the commit it resolved to
    return f"{name} ({digest})" if digest else name


def model_label(record: Record) -> str:
    """How a sweep record's model is named on the page: a random-weight shape as such (with its logit spread
    where it is not the default), any other model by `model_name`."""
    model = record.parameters.model
    spread = spread_suffix(record)
    if weights_of(record) == LABEL:
        return f"{model} (random weights{', ' + spread if spread else ''})"
    return model_name(record)


READABLE = {"noise_band": "band vs fp32", "p99_deviation": "p99 |logit change|", "max_deviation": "max |logit change|",
            "top1_disagreements": "top-1 ≠ fp32", "top1_vs_decode": "top-1 ≠ bf16 decode",
            "largest_flipped_margin": "largest flipped margin"}


def summary_rows(record: Record) -> list[dict]:
    """One row per (kernels, TF32, dtype, shape) of a sweep record: the figures a reader compares, named in
    words (the per-position lists and the median/p90 deviations stay in the record)."""
    return [{"model": model_label(record), "host": record.device, "kernels": row["kernels"], "tf32": row["tf32"],
             "dtype": row["dtype"], "shape": row["shape"], "kind": row["kind"], "positions": row["positions"],
             **{READABLE[key]: row.get(key) for key in READABLE}}
            for row in record.results.rows]


def recorded_band_points() -> list[dict]:
    """`band_points` of every sweep recorded under results/."""
    from spectie.records.store import load_records

    return band_points(load_records(chapter="reduction_order", kind="reduction-sweep"))


def order_band(row: dict, full: dict) -> float:
    """How far the order of the sums alone moves the reference's top-2 margin: the band (same quantile) of a
    shape's margin against the `full` shape's in the same precision and kernels. Both moves are measured
    from the fp32 reference's margin at the same positions, so the reference cancels."""
    import numpy as np

    moved = np.abs(np.asarray(row["margin_shifts"]) - np.asarray(full["margin_shifts"]))
    return float(np.quantile(moved, BAND_QUANTILE))


def band_points(records: list[Record]) -> list[dict]:
    """Noise band per model and precision (the widest over shapes), torch kernels with TF32 off and,
    where measured, the fast kernels: what a `noise band vs model size` plot needs. Each band is split in
    two: `precision`, the `full` shape against the fp32 reference (the same order of sums, another
    precision), and `order`, the widest other shape against `full` in the same precision (another order of
    sums alone); `band`, against the fp32 reference, holds both. `model_parameters` counts the model's
    parameters (0 where the sweep did not record it)."""
    points = []
    for record in records:
        results = record.results
        rows = results.rows
        for (kernels, tf32, dtype) in sorted({(r["kernels"], r["tf32"], r["dtype"]) for r in rows}):
            chosen = [r for r in rows if (r["kernels"], r["tf32"], r["dtype"]) == (kernels, tf32, dtype)]
            full = next((r for r in chosen if r["shape"] == "full"), None)
            others = [r for r in chosen if r is not full]
            points.append({"label": f"{model_label(record)} · {record.device} · {kernels}{' TF32' if tf32 else ''}",
                           "weights": weights_of(record),
                           "model_sha256": record.fingerprint.model_sha256,
                           "gpu": record.fingerprint.gpu,
                           "model_parameters": results.model_parameters or 0, "dtype": dtype,
                           "kernels": kernels, "tf32": tf32, "band": max(r["noise_band"] for r in chosen),
                           "logit_std": (results.weights or {}).get("logit_std"),
                           "top1_median": (results.reference_logits or {}).get("top1_median"),
                           "precision": full["noise_band"] if full else None,
                           "order": max((order_band(r, full) for r in others), default=None) if full else None})
    return points


def trend(values: list[float]) -> str:
    """How a sequence of bands moves with size, in words a sentence can carry ("grows with" ...)."""
    if len(values) < 2:
        return "cannot show a trend with (fewer than two models recorded)"
    steps = [b - a for a, b in zip(values, values[1:])]
    if all(step > 0 for step in steps):
        return "grows with"
    if all(step < 0 for step in steps):
        return "shrinks with"
    return "does not move steadily with"


def largest_bf16_band(points: list[dict]) -> dict:
    """The bf16 band point (TF32 off, any kernels) of the largest model recorded, its widest if it has several,
    among trained models and random-weight shapes at the default logit spread (other spreads are a sweep of that
    free parameter, shown beside them, not a wider band of the same model)."""
    bands = [p for p in points if p["dtype"] == "bfloat16" and not p["tf32"]
             and p["logit_std"] in (None, DEFAULT_LOGIT_STD)]
    return max(bands, key=lambda p: (p["model_parameters"], p["band"]))


def exact_order_text(points: list[dict]) -> str:
    """Which recorded bf16 runs have no order band at all (every shape gave bf16 `full`'s margins exactly),
    in a sentence; a tie there can flip between precisions only, not between two bf16 computations."""
    exact = [p["label"] for p in points if p["dtype"] == "bfloat16" and p["order"] == 0]
    if not exact:
        return ("In every recorded bf16 run some shape moves a margin against that run's own bf16 full forward: "
                "the order of the sums alone makes a band everywhere it was measured")
    return (f"For {'; '.join(exact)} the order of the sums alone makes no band at all: every bf16 shape gave "
            "the bf16 full forward's margins exactly, so however those kernels cut the sequence they summed each logit the same "
            "way. With those kernels a tie there can flip between an fp32 reference and bf16, not between two of "
            "these bf16 computations; vLLM's own kernels sum in orders of their own, which this sweep did not run")


def incident_reach(margin: float, point: dict) -> str:
    """Where a margin falls against a model's bands: inside the order band (two bf16 computations can
    disagree), inside only the band against fp32 (an fp32 reference and a bf16 server can), or outside."""
    label = point["label"]
    if point.get("order") is not None and margin <= point["order"]:
        return (f"it lies inside the band of the order of sums alone of {label}: at that scale two bf16 computations "
                "(plain and speculative decoding) can take opposite sides of a tie of that size")
    if margin <= point["band"]:
        return (f"it lies inside the band against fp32 of {label} but outside its band of the order of sums alone: "
                "at that scale an fp32 reference and a bf16 server can disagree on a tie of that size, two bf16 "
                "computations would not")
    return f"it lies outside every band of {label}: at that scale neither precision nor order would swap it"


def spread_points(points: list[dict], model: str) -> list[dict]:
    """The bf16 band points (torch kernels, TF32 off) of one random-weight shape, one per logit spread."""
    return [p for p in points if p["label"].startswith(f"{model} (random weights") and p["dtype"] == "bfloat16"
            and p["kernels"] == "torch" and not p["tf32"] and p.get("logit_std") is not None]


def calibration_text(points: list[dict], top1: float) -> str:
    """Where the incident's top logit (`top1`, reported, at its stop) falls among the median top-1 logits of
    the fp32 references of the recorded spreads, and the bands there; or why it cannot be said. A median over
    positions against one position's logit: a rough calibration, and said so."""
    known = sorted((p for p in points if p.get("top1_median") is not None), key=lambda p: p["top1_median"])
    if not known:
        return ("no sweep of this shape records its logits' magnitudes, so no spread is calibrated to the "
                "incident's")
    below = [p for p in known if p["top1_median"] <= top1]
    above = [p for p in known if p["top1_median"] > top1]
    if not below or not above:
        best = (below or above)[-1 if below else 0]
        side = "above" if below else "below"
        return (f"the incident's top logit at its stop ({top1:.2f}, reported) lies {side} the median top-1 logit of "
                f"every spread recorded; the nearest, spread {best['logit_std']:g} (top-1 {best['top1_median']:.1f}), "
                f"has a band against fp32 of {best['band']:.3f} logits, precision alone {best['precision']:.3f} and "
                f"the order of sums alone {best['order']:.3f}")
    low, high = below[-1], above[0]

    def span(key):
        return f"{low[key]:.3f} to {high[key]:.3f}"

    return (f"the incident's top logit at its stop ({top1:.2f}, reported) lies between the median top-1 logits of "
            f"the fp32 references at spreads {low['logit_std']:g} ({low['top1_median']:.1f}) and "
            f"{high['logit_std']:g} ({high['top1_median']:.1f}); there the band against fp32 runs from "
            f"{span('band')} logits, precision alone from {span('precision')} and the order of sums alone from "
            f"{span('order')} (a median over positions set against one position's logit: a rough calibration)")


def bf16_order_text(margin: float, records: list[Record]) -> str:
    """Where a margin falls against the bands of the order of sums alone (bf16 against bf16: what plain and
    speculative decoding are), per model size recorded at the default logit spread, in a sentence; "" if none."""
    points = [p for p in band_points([r for r in records if r.kind == "reduction-sweep"])
              if p["dtype"] == "bfloat16" and not p["tf32"] and p["order"] is not None
              and p["logit_std"] in (None, DEFAULT_LOGIT_STD)]
    widest: dict[str, dict] = {}
    for p in points:  # per model, its widest order band over kernels and devices
        name = p["label"].split(" · ")[0]
        if name not in widest or p["order"] > widest[name]["order"]:
            widest[name] = p
    if not widest:
        return ""
    ordered = sorted(widest.items(), key=lambda kv: kv[1]["model_parameters"])
    inside = [name for name, p in ordered if margin <= p["order"]]
    listed = "; ".join(f"{name}: {p['order']:.2f}" for name, p in ordered)
    verdict = (f"a margin of {margin:.2f} lies inside the band of {', '.join(inside)}" if inside else
               f"a margin of {margin:.2f} lies outside every one of them")
    return (f"Plain and speculative decoding are both bf16, so the band that fits them is the order of sums alone "
            f"(bf16 against bf16; measured, widest per model at the default logit spread: {listed} logits): "
            f"{verdict}. The random-weight shapes' bands grow with the logit spread chosen for their weights, so "
            "they do not settle Qwen3.5's own")
