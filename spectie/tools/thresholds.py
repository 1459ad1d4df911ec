"""The tools' thresholds, in logits: the classifier's is the widest bf16 noise band recorded for these very weights
(the reduction-order chapter's sweeps, on this device where one is recorded), else the incident's reported
fp32-to-bf16 swing on its real Qwen3.5; the tie-stop detector's is at least one bf16 step at the logits recorded for
these weights (it reads margins vLLM served from bf16 logits). Each comes with a label saying where it is from.

    band, origin = threshold_for_model("artifacts/organism")            # the classifier's
    step, origin = detector_threshold_for_model("artifacts/organism")   # the detector's
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spectie.records.record_types import Record


REFERENCE_ID = "hf-reference-logits-1854"  # the incident's fp32 and bf16 transformers references at the stop


@dataclass(frozen=True)
class Reference:
    """Two references of one model at one position: the margin of the first token over the second (signed)."""

    tokens: tuple[str, str]
    fp32: float
    bf16: float
    position: int | None
    record_id: str

    @property
    def swing(self) -> float:
        return abs(self.fp32 - self.bf16)

    @property
    def flipped(self) -> bool:
        return (self.fp32 > 0) != (self.bf16 > 0)


def reference(record: Record) -> Reference:
    """The margins of a logit-comparison record, signed as EOS over its rival."""
    rows = {row["dtype"]: row for row in record.results.rows}
    fp32, bf16 = rows.get("fp32") or rows["float32"], rows.get("bf16") or rows["bfloat16"]
    first = fp32["winner"]
    rival = next(token for token in fp32["logits"] if token != first)
    pair = (first, rival) if first in ("EOS", "<|endoftext|>") else (rival, first)

    def signed(row):
        return row["logits"][pair[0]] - row["logits"][pair[1]]

    return Reference(pair, signed(fp32), signed(bf16), record.results.position, record.id)


def reported_swing(record: Record | None = None) -> tuple[float, str]:
    """How far the EOS-DATA margin moved between the fp32 and bf16 transformers references at the incident's
    stop on its real Qwen3.5 (reported, not measured here), and a label saying so."""
    if record is None:
        from spectie.records.store import load_records

        [record] = [r for r in load_records(chapter="incident") if r.id == REFERENCE_ID]
    swing = reference(record).swing
    return swing, (f"reported: the EOS-DATA margin moved {swing:.2f} logits between the fp32 and bf16 references on "
                   f"the incident's Qwen3.5 (record {record.id}); no band is recorded for these weights: "
                   "`make run CHAPTER=reduction_order MODEL=<model>` records one")


def default_threshold(digest: str | None = None, records: list[Record] | None = None,
                      device: str | None = None) -> tuple[float, str]:
    """The widest bf16 noise band (TF32 off, any GDN kernels) recorded for these very weights (`digest`) — on
    that `device` (a GPU's name, or "CPU") where one is recorded there, else on any — else the incident's
    reported fp32-vs-bf16 swing on a real Qwen3.5; and a label saying which it is. (A band of a random-weight
    shape is not used: its scale is a free parameter of the random weights.)"""
    from spectie.lab.bands import band_points, recorded_band_points

    recorded = recorded_band_points() if records is None else band_points(records)
    same = [p for p in recorded if p["dtype"] == "bfloat16" and not p["tf32"] and digest
            and p.get("model_sha256") == digest]
    same = [p for p in same if device and (p.get("gpu") or "CPU") == device] or same
    if same:
        widest = max(same, key=lambda p: p["band"])
        return widest["band"], f"bf16 noise band of {widest['label']}"
    return reported_swing()


def bf16_step(magnitude: float) -> float:
    """The spacing of bfloat16 numbers at `magnitude` (8 significant bits): two bf16 logits of that size differ
    by a whole number of it, so a margin vLLM serves from bf16 logits there is 0 or at least one step."""
    return 2.0 ** (math.floor(math.log2(abs(magnitude))) - 7) if magnitude else 0.0


def recorded_logits(digest: str | None, records: list[Record] | None = None) -> tuple[float, str] | None:
    """The largest logit (in magnitude) recorded at a stop decision of these very weights (the margins
    chapter's logit comparisons, any dtype), and the record it is in; None when no such record exists."""
    if records is None:
        from spectie.records.store import load_records

        records = load_records(kind="logit-comparison")
    found = [(abs(value), r.id) for r in records if r.kind == "logit-comparison" and digest
             and r.fingerprint and r.fingerprint.model_sha256 == digest
             for row in r.results.rows for value in row["logits"].values()]
    return max(found) if found else None


def step_rule(band: float, band_origin: str, logits: tuple[float, str] | None) -> tuple[float, str]:
    """The detector's threshold: the larger of the recorded band and one bf16 step at the logits' magnitude
    (a served margin cannot be smaller than one step without being 0), with a label saying which it is."""
    if logits is None:
        return band, band_origin
    magnitude, record_id = logits
    step = bf16_step(magnitude)
    if step <= band:
        return band, f"{band_origin}; wider than one bf16 step ({step:g}) at the logits recorded for these weights"
    return step, (f"one bf16 step at the logits recorded for these weights (|logit| up to {magnitude:.1f}, record "
                  f"{record_id}), wider than the {band_origin} ({band:.3f} logits)")


def threshold_for_model(model_path: str, device: str | None = None) -> tuple[float, str]:
    """`default_threshold` for a model folder (or hub id), matched by its weights' digest, preferring the band
    recorded on `device` (default: this machine's, `fingerprint.device_name`). The classifier's band: it compares
    fp32 margins, which are not bf16-rounded."""
    from spectie.records.fingerprint import device_name, model_digest

    return default_threshold(digest=model_digest(model_path), device=device or device_name())


def detector_threshold_for_model(model_path: str, device: str | None = None) -> tuple[float, str]:
    """The detector's threshold for a model folder (or hub id): the larger of its band (`threshold_for_model`)
    and one bf16 step at the logits recorded for these weights (`step_rule`), since the detector reads margins
    that vLLM served from bf16 logits."""
    from spectie.records.fingerprint import model_digest

    band, origin = threshold_for_model(model_path, device)
    return step_rule(band, origin, recorded_logits(model_digest(model_path)))
