"""The project's one memory estimate: what a model needs in a precision, what is free where it will live, and the
refusal when it does not fit (used by the host check of `make run`, the chapters before they load a model, and
random-weight shapes before they are built). It imports nothing of the package but the GPU reader."""

from __future__ import annotations

from spectie.records.errors import UsageError
from spectie.records.fingerprint import gpus, host_memory

GIB = 2**30
SLACK = 1.25  # activations, the other precision's copy during a cast, the allocator's reserve
BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}  # per parameter (spectie.lab.model.DTYPES)


def needed(parameters: int, dtype: str, built_in_float32: bool = False) -> int:
    """Bytes for `parameters` in `dtype`, with their float32 copy when the weights are built in float32 and then
    cast (random-weight shapes), times SLACK."""
    if dtype not in BYTES:
        raise UsageError(f"unknown dtype {dtype!r}; valid: {', '.join(BYTES)}")
    return int(parameters * (BYTES[dtype] + 4 * (built_in_float32 and dtype != "float32")) * SLACK)


def free(device: str, found: list | None = None) -> tuple[int, str]:
    """Bytes free where a model on `device` lives, and where that is: the first GPU's (nvidia-smi; `found`: the
    GPUs already read) for cuda, else the memory available on this host."""
    if device.startswith("cuda"):
        found = gpus() if found is None else found
    else:
        found = []
    return (found[0].free, "free on the GPU") if found else (host_memory(), "available on this host")


def shortfall(model: str, need: int, dtype: str, available: int, where: str) -> str | None:
    """Why `model` does not fit (None where it does)."""
    if need <= available:
        return None
    return (f"model {model!r} needs about {need / GIB:.1f} GiB in {dtype}, only {available / GIB:.1f} GiB {where}: "
            "free memory or use a host with more")


def check_fits(model: str, parameters: int, dtypes: list[str], device: str, built_in_float32: bool = False) -> None:
    """Refuse a precision whose model cannot fit, saying what it needs and what is free."""
    available, where = free(device)
    for dtype in dtypes:
        why = shortfall(model, needed(parameters, dtype, built_in_float32), dtype, available, where)
        if why:
            raise UsageError(why)
