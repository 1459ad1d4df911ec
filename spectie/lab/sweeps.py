"""What a reduction-order sweep record says of its weights and its band, for the code that writes it
(`reduction_order`, `qwen_shapes`) and the code that reads it (`bands`, the pages): a random-weight shape's label and
default logit spread, and the quantile of the margin shifts that is the noise band."""

from __future__ import annotations

LABEL = "random-weight shape"  # what a sweep of a Qwen3.5 shape with random weights calls its weights
DEFAULT_LOGIT_STD = 3.0  # the logit spread a random-weight shape is scaled to, unless a sweep says otherwise
BAND_QUANTILE = 0.99  # the noise band: this quantile of |margin shift| over a sweep's pairs


def spread_of(weights: dict | None) -> str:
    """A sweep's weights' logit spread in words, where they are a random-weight shape's other than the default."""
    weights = weights or {}
    if weights.get("kind") != LABEL or weights.get("logit_std", DEFAULT_LOGIT_STD) == DEFAULT_LOGIT_STD:
        return ""
    return f"logit spread {weights['logit_std']:g}"


def weights_kind(weights: dict | None) -> str:
    """What a sweep's weights are: `trained checkpoint` (also where a sweep from before shapes says nothing) or LABEL."""
    return (weights or {}).get("kind", "trained checkpoint")


def spread_suffix(record) -> str:
    """A random-weight shape's logit spread, when it is not the default one (records and labels name it)."""
    return spread_of(record.results.weights)


def weights_of(record) -> str:
    """`trained checkpoint` or `random-weight shape` of a sweep record (records from before shapes existed:
    trained)."""
    return weights_kind(record.results.weights)
