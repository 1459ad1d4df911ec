"""The reduction-order chapter's glue values, from its records (spectie.lab.reduction_order measures and writes the
sweeps, spectie.lab.bench the benchmarks): each function returns {name: value} for one section of the page
(spectie.book.pages.glue_all glues them).

    record = reduction_order.run(...)
    values = reduction_order_page.run_values(record, kernels, tf32)
"""

from __future__ import annotations

import pandas as pd

from spectie.lab import bands, host, qwen_shapes, reduction_order, sweeps
from spectie.book import plots
from spectie.book.incident import fp32_row
from spectie.lab.margins import flip_curve
from spectie.lab.memory import GIB
from spectie.records.record_types import Record
from spectie.records.store import provenance_line

MARGIN_EDGES = [0, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 100]  # fp32-margin bins of the flip curves
TF32 = {True: "on", False: "off"}  # said as a reader reads it, not as Python's booleans
SPREAD_SHAPE = "qwen3.5-9b-shape"  # the random-weight shape whose band is shown against the spread of its logits


def run_values(record: Record, kernels: list[str], tf32: list[bool]) -> dict:
    """This run's sweep: its rows (a table), the bf16 band and top-1 differences under the first kernels and TF32
    setting, the fp32-head band, and three figures (top-1 differences, margin moves, flip probability)."""
    result, rows = record.results, record.results.rows
    table = pd.DataFrame(bands.summary_rows(record)).drop(columns=["model", "host", "kind", "positions"])
    table = table.assign(tf32=table["tf32"].map(TF32)).set_index(["kernels", "tf32", "dtype", "shape"])
    chosen = [r for r in rows if r["kernels"] == kernels[0] and r["tf32"] == tf32[0]]
    bf16 = [r for r in chosen if r["dtype"] == "bfloat16"]
    head = [r for r in chosen if r["dtype"] == "bfloat16" + reduction_order.FP32_HEAD]
    curves = {r["shape"]: flip_curve(r["pairs"], MARGIN_EDGES) for r in bf16}
    return {
        "this_table": table.style.format(precision=4, na_rep="—"), "this_model": bands.model_label(record),
        "head_note": f"{max(r['noise_band'] for r in head):.3f} logits, with up to "
                     f"{max(r['top1_disagreements'] for r in head)} top-1 differences" if head else
                     "not measured in this run (add bfloat16+fp32-head to dtypes)",
        "positions": result.positions,
        "bf16_band": max(r["noise_band"] for r in bf16) if bf16 else float("nan"),
        "bf16_top1": max(r["top1_disagreements"] for r in bf16) if bf16 else 0,
        "bf16_vs_decode": max(r.get("top1_vs_decode", 0) for r in bf16) if bf16 else 0,
        "heatmap": plots.disagreement_heatmap(rows, "top-1 differs from the fp32 reference (this run)"),
        "boxes": plots.margin_shift_boxes(rows, sweeps.BAND_QUANTILE, "margin moves per shape (this run)"),
        "flips": plots.flip_probability_by_shape(curves, "bf16: flip probability by the fp32 margin (this run)"),
        "run_provenance": provenance_line([record])}


def band_table(points: list[dict]):
    """Every recorded band point as a table (a reader's column names)."""
    table = pd.DataFrame(points).drop(columns=["weights", "model_sha256", "gpu"]).rename(columns={
        "model_parameters": "parameters", "band": "against fp32 (widest shape)", "precision": "precision: full vs fp32",
        "order": "order alone: widest shape vs full"})
    table["tf32"] = table["tf32"].map(TF32)
    return table.style.format(precision=4, na_rep="—").hide(axis="index")


def all_rows_table(records: list[Record]):
    """Every recorded sweep's rows as one table."""
    rows = pd.DataFrame([row for r in records for row in bands.summary_rows(r)])
    rows = rows.drop(columns=["kind", "positions"]).assign(tf32=lambda d: d["tf32"].map(TF32))
    return rows.set_index(["model", "host", "kernels", "tf32", "dtype", "shape"]).style.format(precision=4, na_rep="—")


def spread_values(points: list[dict], incident: dict, records: list[Record]) -> dict:
    """A random-weight shape's band against the logit spread of its weights, calibrated to the incident's logits."""
    spread = bands.spread_points(points, SPREAD_SHAPE)
    return {"spread_shape": SPREAD_SHAPE,
            "spread_values": ", ".join(f"{p['logit_std']:g}" for p in sorted(spread, key=lambda p: p["logit_std"]))
            or "none",
            "spread_text": bands.calibration_text(spread, max(incident["logits"].values())),
            "spread_figure": plots.band_by_spread(spread, incident["margin"],
                                                  f"{SPREAD_SHAPE}: bf16 bands by logit spread")
            if len(spread) > 1 else f"fewer than two logit spreads recorded for {SPREAD_SHAPE}: no curve",
            "spread_provenance": provenance_line([r for r in records if r.parameters.model == SPREAD_SHAPE])}


def records_values(records: list[Record], reported: list[Record]) -> dict:
    """Every recorded sweep: the band per model, precision and kernels (a figure and tables), the widest bf16 band
    against the incident's margin, the bands' growth over the random-weight shapes, and flips pooled per model."""
    incident = fp32_row(reported)
    points = bands.band_points(records)
    default_spread = [p for p in points if p["logit_std"] in (None, sweeps.DEFAULT_LOGIT_STD)]
    shape_bands = sorted((p for p in default_spread if p["dtype"] == "bfloat16" and not p["tf32"]
                          and p["weights"] == sweeps.LABEL and p["kernels"] == "torch"),
                         key=lambda p: p["model_parameters"])
    largest = bands.largest_bf16_band(points)
    pooled = {bands.model_label(r) + " · " + r.device:
              flip_curve([pair for row in r.results.rows if row["dtype"] == "bfloat16"
                          and row["kernels"] == "torch" and not row["tf32"] for pair in row["pairs"]], MARGIN_EDGES)
              for r in records}
    stds = sorted({p["logit_std"] for p in default_spread if p["logit_std"] is not None}) or [
        sweeps.DEFAULT_LOGIT_STD]
    return {
        "incident_margin": incident["margin"],
        "band_plot": plots.band_by_model(default_spread, incident["margin"], "noise band per model, precision and kernels"),
        **spread_values(points, incident, records), "band_table": band_table(points), "all_rows": all_rows_table(records),
        "largest_label": largest["label"], "largest_band": largest["band"], "largest_precision": largest["precision"],
        "largest_order": largest["order"], "incident_verdict": bands.incident_reach(incident["margin"], largest),
        "exact_order_text": bands.exact_order_text(points),
        "shape_trend": bands.trend([p["band"] for p in shape_bands]),
        "shape_growth": " → ".join(f"{p['band']:.2f} ({p['label'].split(' (')[0].replace('qwen3.5-', '')})"
                                   for p in shape_bands) or "no random-weight shape recorded",
        "shape_logit_std": " or ".join(f"{std:g}" for std in stds),
        "gib_9b_fp32": host.memory_needed("qwen3.5-9b-shape", "float32") / GIB,
        "pooled_flips": plots.flip_probability_by_shape(pooled, "bf16, every shape pooled: flip probability per model"),
        "records_provenance": provenance_line(records)}


def bench_table(records: list[Record]):
    """Every recorded benchmark's rows as a table, or what runs one."""
    rows = pd.DataFrame([{"host": r.device, "model": r.parameters.model, **row}
                         for r in records for row in r.results.rows])
    if not len(rows):
        return "no benchmark recorded yet: run make bench"
    rows["TFLOP/s"] = rows.get("flops_per_s", float("nan")) / 1e12
    rows = rows.drop(columns=[c for c in ("flops_per_s",) if c in rows]).rename(columns={
        "share_of_bf16_matmul": "share of the bf16 matmul rate", "tokens_per_s": "tokens/s",
        "vs_plain_forward": "× a plain forward"})
    return rows.set_index(["host", "model", "dtype", "shape"]).style.format(precision=3, na_rep="—")


def bench_values(records: list[Record]) -> dict:
    """The benchmarks: a table of every one, and the largest model's GPU benchmark in figures (where one is)."""
    from spectie.lab import bench

    gpu = [r for r in records if r.results.bf16_matmul_flops_per_s]
    largest = max(gpu, key=lambda r: qwen_shapes.parameter_count(r.parameters.model)
                  if qwen_shapes.is_shape(r.parameters.model) else 0, default=None)
    shapes = largest.parameters.shapes if largest else list(bench.SHAPES)
    values = {"bench_table": bench_table(records), "bench_matmul_size": bench.GPU_MATMUL_SIZE,
              "bench_ks": ", ".join(s.split("-", 1)[1] for s in shapes if s.startswith("verify-"))}
    if largest:
        rows = {(row["dtype"], row["shape"]): row for row in largest.results.rows}
        values.update({
            "bench_model": largest.parameters.model, "bench_gpu": largest.fingerprint.gpu,
            "bench_matmul": largest.results.bf16_matmul_flops_per_s / 1e12,
            "bench_scan_s": rows[("bfloat16", "full")]["seconds"],
            "bench_scan_ratio": rows[("bfloat16", "full")]["vs_plain_forward"],
            "bench_plain_tflops": rows[("bfloat16", "plain forward")]["flops_per_s"] / 1e12,
            "bench_plain_share": rows[("bfloat16", "plain forward")]["share_of_bf16_matmul"] * 100,
            "bench_decode_ratio": rows[("bfloat16", "decode")]["vs_plain_forward"],
            "bench_verify7_ratio": rows[("bfloat16", "verify-7")]["vs_plain_forward"]})
    return values
