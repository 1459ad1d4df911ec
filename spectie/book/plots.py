"""Figures of the book, drawn from records with matplotlib.

Each function returns a closed figure: it is shown where the notebook glues it, not a second time
at the end of the cell.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

def _finish(fig, ax, title: str):
    """Title, tight layout, and the figure closed (glue shows it once, where the page places it)."""
    ax.set_title(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


COLOURS = {"fp64": "#1b9e77", "fp32": "#7570b3", "bf16": "#d95f02", "fp16": "#e7298a", "bf16, fp32 head": "#66a61e"}


def margin_along_continuation(rows: list[dict], dtypes: list[str], pair: tuple[str, str], title: str):
    """The watched pair's logit difference at every generated position, one line per dtype."""
    a, b = pair
    fig, ax = plt.subplots(figsize=(8, 3.4))
    positions = [r["position"] for r in rows]
    # Most precise first and widest, so that lines lying on top of each other stay visible.
    for i, short in enumerate(dtypes):
        ax.plot(positions, [r[f"{short}_diff"] for r in rows], label=short, color=COLOURS.get(short),
                linewidth=4.5 - 1.5 * i, alpha=0.8, marker="." if i == len(dtypes) - 1 else None)
    ax.axhline(0, color="black", linewidth=0.8)
    for r in rows:
        if r["top1_disagree"]:
            ax.axvline(r["position"], color="red", alpha=0.25, linewidth=4)
    ax.set_xlabel("position in the sequence")
    ax.set_ylabel(f"logit({a}) − logit({b})")
    ax.legend(loc="best", fontsize=8)
    return _finish(fig, ax, title)


def flip_rate_vs_margin(bins: list[dict], reference: str, other: str, title: str):
    """Share of positions whose top-1 token differs between `other` and `reference`, by margin."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [f"{b['low']:g}–{b['high']:g}" for b in bins]
    rates = [b["flip_rate"] if b["flip_rate"] is not None else 0 for b in bins]
    bars = ax.bar(range(len(bins)), rates, color=COLOURS.get(other, "grey"))
    for bar, b in zip(bars, bins):
        ax.annotate(f"{b['flips']}/{b['count']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(bins)), labels, rotation=30, fontsize=8)
    ax.set_xlabel(f"{reference} margin between the top two tokens (logits)")
    ax.set_ylabel(f"share where {other} picks another top-1")
    ax.set_ylim(0, 1.1)
    return _finish(fig, ax, title)


def bf16_grid(values: dict[str, float], title: str):
    """Where logits sit on the grid of bf16 numbers: the steps a near-tie is made of. The grid is bf16's own:
    its spacing halves below each power of two (0.0625 below 16, 0.125 from 16 to 32)."""
    from spectie.lab.margins import bf16_spacing

    low, high = min(values.values()), max(values.values())
    low -= 2 * bf16_spacing(low)
    high += 2 * bf16_spacing(high)
    fig, ax = plt.subplots(figsize=(8, 1.8))
    tick = low - (low % bf16_spacing(low))
    spacings = set()
    while tick <= high:
        ax.axvline(tick, color="#bbbbbb", linewidth=0.8)
        spacings.add(bf16_spacing(tick))
        tick += bf16_spacing(tick)
    for i, (name, value) in enumerate(values.items()):
        ax.plot([value], [0.3 + 0.4 * (i % 2)], "o", color=list(COLOURS.values())[i % 4])
        ax.annotate(f"{name} {value:.2f}", (value, 0.3 + 0.4 * (i % 2)), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel(f"logit (grey lines: adjacent bf16 values, {' or '.join(f'{s:g}' for s in sorted(spacings))} apart)")
    return _finish(fig, ax, title)


def disagreement_heatmap(rows: list[dict], title: str):
    """Shape × generated position: red where the shape's top-1 differs from the reference's."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.5))
    grid = np.array([[1.0 if flipped else 0.0 for _, flipped in r["pairs"]] for r in rows])
    ax.imshow(grid, aspect="auto", cmap="Reds", vmin=0, vmax=1.4, interpolation="nearest")
    ax.set_yticks(range(len(rows)), [f"{r['dtype']} {r['shape']}" for r in rows], fontsize=7)
    ax.set_xlabel("generated position (output token index)")
    return _finish(fig, ax, title)


def margin_shift_boxes(rows: list[dict], band_quantile: float, title: str):
    """How far each shape moves the reference's top-two margin, per position (box plots)."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.boxplot([[abs(x) for x in r["margin_shifts"]] for r in rows], showfliers=True)
    ax.set_xticks(range(1, len(rows) + 1), [f"{SHORT.get(r['dtype'], r['dtype'])}\n{r['shape']}" for r in rows], fontsize=6,
                  rotation=90)
    ax.scatter(range(1, len(rows) + 1), [r["noise_band"] for r in rows], marker="_", s=200, color="red",
               zorder=3, label=f"noise band ({band_quantile:.0%} quantile)")
    ax.set_ylabel("|change of the top-two margin| (logits)")
    ax.legend(loc="upper left", fontsize=8)
    return _finish(fig, ax, title)


def flip_probability_by_shape(curves: dict[str, list[dict]], title: str):
    """Share of positions whose top-1 differs from the reference, by the reference's top-two margin,
    one line per shape (`curves`: shape -> bins of `margins.flip_curve`)."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for shape, bins in curves.items():
        centres = [(b["low"] + b["high"]) / 2 for b in bins if b["count"]]
        ax.plot(centres, [b["flip_rate"] for b in bins if b["count"]], marker="o", markersize=3, linewidth=1,
                label=shape)
    ax.set_xscale("log")
    ax.set_xlabel("reference (fp32) margin between the top two tokens (logits)")
    ax.set_ylabel("flip probability")
    ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _finish(fig, ax, title)


BAND_FLOOR = 1e-5  # a band of 0 (the reference's own computation) is drawn here on the log axis
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
         "bfloat16+fp32-head": "bf16, fp32 head"}


def band_by_model(points: list[dict], incident_margin: float | None, title: str):
    """Noise band per model (x: its parameter count), TF32 off: one colour per precision, solid for the torch
    GDN kernels and dotted for fla; hollow circles are random-weight shapes, squares trained models."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    untf32 = [p for p in points if not p["tf32"]]
    for dtype, kernels in sorted({(p["dtype"], p["kernels"]) for p in untf32}):
        chosen = sorted((p for p in untf32 if (p["dtype"], p["kernels"]) == (dtype, kernels)),
                        key=lambda p: p["model_parameters"])
        colour = COLOURS.get(SHORT.get(dtype))
        name = f"{SHORT.get(dtype, dtype)} {kernels}"
        shapes = [p for p in chosen if p["weights"] == "random-weight shape"]
        trained = [p for p in chosen if p["weights"] != "random-weight shape"]
        if shapes:
            ax.plot([p["model_parameters"] for p in shapes], [max(p["band"], BAND_FLOOR) for p in shapes],
                    marker="o", mfc="white", linestyle="-" if kernels == "torch" else ":", color=colour,
                    label=f"{name} (random-weight shapes)")
        if trained:
            ax.plot([p["model_parameters"] for p in trained], [max(p["band"], BAND_FLOOR) for p in trained],
                    marker="s", linestyle="none", color=colour, label=f"{name} (trained)")
    ticks = {}
    for p in untf32:  # one x tick per model, named
        tick = p["label"].split(" · ")[0].replace(" (random weights)", "").replace("qwen3.5-", "")
        ticks[p["model_parameters"]] = tick
    if incident_margin is not None:
        ax.axhline(incident_margin, color="black", linestyle="--", linewidth=1,
                   label=f"incident's fp32 margin ({incident_margin:.2f}, reported)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(ticks), [f"{name}\n{x / 1e9:.2g} B" for x, name in ticks.items()], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("model parameters")
    ax.set_ylabel("noise band (logits)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _finish(fig, ax, title)


def band_by_spread(points: list[dict], incident_margin: float, title: str):
    """One random-weight shape's bf16 bands (TF32 off, torch kernels) against the logit spread its weights
    were scaled to: against fp32, precision alone and the order of sums alone; the median top-1 logit of the
    fp32 reference above each point (the incident's were about 16, reported)."""
    fig, ax = plt.subplots(figsize=(9, 3.4))
    chosen = sorted(points, key=lambda p: p["logit_std"])
    x = [p["logit_std"] for p in chosen]
    for key, name, style in (("band", "against fp32", "-"), ("precision", "precision alone (full vs fp32)", "--"),
                             ("order", "order of sums alone (widest shape vs full)", ":")):
        ax.plot(x, [p[key] for p in chosen], marker="o", linestyle=style, label=name)
    for p in chosen:
        if p.get("top1_median") is not None:
            ax.annotate(f"top-1 ≈ {p['top1_median']:.1f}", (p["logit_std"], p["band"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(incident_margin, color="black", linestyle="--", linewidth=1,
               label=f"incident's fp32 margin ({incident_margin:.2f}, reported)")
    ax.set_xlabel("logit spread of the random weights (standard deviation over the vocabulary)")
    ax.set_ylabel("bf16 band (logits)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _finish(fig, ax, title)


def stop_margins(margins: dict[str, list[float]], threshold: float, bands: dict[str, float], title: str):
    """Stop-token margins of a tie-stop survey (`margins`: "ordinary" and "moved" stops), one dot per stop,
    against the detector's threshold and other noise bands (`bands`: label -> logits) as vertical lines."""
    fig, ax = plt.subplots(figsize=(9, 2.8))
    for row, (kind, values) in enumerate(margins.items()):
        ax.scatter(values, [row] * len(values), s=18, alpha=0.6, label=f"{kind} stops ({len(values)})")
    ax.axvline(threshold, color="black", linewidth=1.2, label=f"threshold {threshold:.3f}")
    for (label, band), style in zip(bands.items(), (":", "-.", "--")):
        ax.axvline(band, color="grey", linestyle=style, linewidth=1, label=f"{label} {band:.2f}")
    ax.set_yticks(range(len(margins)), list(margins))
    ax.set_ylim(-0.6, len(margins) - 0.4)
    ax.set_xlabel("stop token's logprob margin over the runner-up (logits)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _finish(fig, ax, title)


def designed_decisions(rows: list[dict], pair: tuple[str, str], reference: str, serving: str, band: float,
                       title: str):
    """The watched pair's difference at each prompt's designed decision: the reference precision (filled)
    and the serving precision (open), joined by a line; the grey strip is the band, ±`band` around a tie."""
    a, b = pair
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.6))
    ax.axvspan(-band, band, color="#dddddd", zorder=0, label=f"band (±{band:.3f})")
    ax.axvline(0, color="black", linewidth=0.8)
    for i, row in enumerate(rows):
        x0, x1 = row[f"{reference}_diff"], row[f"{serving}_diff"]
        flipped = row[f"{reference}_winner"] != row[f"{serving}_winner"]
        ax.plot([x0, x1], [i, i], color="red" if flipped else "#999999", linewidth=1.5, zorder=1)
        ax.plot([x0], [i], "o", color=COLOURS.get(reference), zorder=2, label=reference if i == 0 else None)
        ax.plot([x1], [i], "o", mfc="white", color=COLOURS.get(serving), zorder=2, label=serving if i == 0 else None)
    ax.set_yticks(range(len(rows)), [f"seed {row['seed']}" for row in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"logit({a}) − logit({b}) at the decision   (> 0: {a} wins; red: the precisions pick different tokens)")
    ax.legend(loc="best", fontsize=8)
    return _finish(fig, ax, title)


def detector_curve(rows: list[dict], marks: dict[str, float], title: str):
    """The detector's rates over thresholds (`survey.detector_curve`): false positives on ordinary stops, recall on
    planted truncations at near-tie and at confident positions; `marks`: thresholds to draw as labelled lines."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    thresholds = [r["threshold"] for r in rows]
    lines = {"false_positive_rate": ("false positives on ordinary stops", "#d95f02", "-"),
             "near-tie recall": ("recall: truncations planted at near-ties", "#1b9e77", "-"),
             "confident recall": ("recall: truncations planted at confident positions", "#7570b3", "--")}
    for key, (label, colour, style) in lines.items():
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            ax.plot(thresholds, [float("nan") if v is None else v for v in values], label=label, color=colour,
                    linestyle=style, linewidth=2, drawstyle="steps-post")
    for i, (name, value) in enumerate(marks.items()):
        ax.axvline(value, color="black", alpha=0.6, linewidth=1, linestyle=":" if i else "-")
        ax.annotate(name, (value, 0.3 + 0.15 * i), xytext=(4, 0), textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("threshold: a stop is flagged when |its margin| is below it (logits)")
    ax.set_ylabel("share flagged")
    ax.set_ylim(-0.03, 1.05)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)
    return _finish(fig, ax, title)



def path_outcomes(rows: list[dict], title: str):
    """Per vLLM release and speculative path (`rows`: label, generations, parted, stopped, bug), the share of its
    generations that parted from plain greedy (light) and that stopped earlier than plain greedy (dark), coloured
    by the classifier's verdict on its divergences (a suspected bug, or near-ties)."""
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.6))
    for i, row in enumerate(rows):
        colour = "#c44e52" if row["bug"] else "#4c72b0"
        ax.barh(i, row["parted"] / row["generations"], color=colour, alpha=0.3, height=0.7)
        ax.barh(i, row["stopped"] / row["generations"], color=colour, height=0.7)
        ax.text(1.01, i, f"{row['stopped']} stopped, {row['parted']} parted\nof {row['generations']}", va="center",
                fontsize=9)
    ax.set_yticks(range(len(rows)), [row["label"] for row in rows], fontsize=10)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the generations (light: parted from plain greedy; dark: stopped earlier than it)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#c44e52")]
    ax.legend(handles, ["divergences near-ties", "suspected correctness bugs"], fontsize=9, loc="lower right")
    return _finish(fig, ax, title)
