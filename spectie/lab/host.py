"""Host checks before a chapter runs here (`make run`): the GPU and driver the environment names, and
the memory the model needs, read before anything heavy starts.

A run's records are labelled with the environment it was given; a GPU run labelled `cpu`, or an H200
run labelled as another GPU, would put numbers in the wrong column of the book. So a host that does not
match its environment's GPU is refused, with what was found and what to do.

A driver the environment names is what its reporter had (v0.31.0-rtx4090x2 names the reporter's WSL
driver); another driver here is said and recorded (the record's fingerprint), not refused, unless the
check is strict: `check(..., strict=True)`, which `make run` asks for with SPECTIE_STRICT_HOST=1.
"""

from __future__ import annotations

from pathlib import Path

from spectie.lab import memory
from spectie.records.errors import UsageError
from spectie.records.fingerprint import gpus
from spectie.lab.memory import GIB

MODEL_DTYPE = {"reproduce": "bfloat16"}  # vLLM serves the checkpoint's bf16; the others compute fp32 references


def model_parameters(model: str) -> int:
    """Parameters of a model (the organism, a random-weight shape, a folder or a cached hub id), from its
    config alone: nothing is loaded."""
    from spectie.lab import qwen_shapes

    if model in qwen_shapes.SHAPES:
        return qwen_shapes.parameter_count(model)
    from spectie.lab.model import resolve_model

    path = resolve_model(model)
    counted = release_parameters(Path(path))
    if counted:
        return counted
    from transformers import AutoConfig

    from spectie.lab.model import parameter_count

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - any failure here means the chapter cannot load it either
        raise UsageError(f"cannot read the config of model {model!r} ({path}): {error}") from None
    return parameter_count(getattr(config, "text_config", config))


def memory_needed(model: str, dtype: str) -> int:
    """Bytes to hold `model` (the organism, a random-weight shape, a folder or a cached hub id) in `dtype`: the
    project's one estimate (spectie.lab.memory) over the model's parameters, counted from its files or config."""
    from spectie.lab import qwen_shapes

    return memory.needed(model_parameters(model), dtype, built_in_float32=qwen_shapes.is_shape(model))


def check_fits(model: str, dtypes: list[str], device: str) -> None:
    """Refuse, before anything is loaded or built, a precision whose model cannot fit, saying what it needs."""
    from spectie.lab import qwen_shapes

    memory.check_fits(model, model_parameters(model), dtypes, device, built_in_float32=qwen_shapes.is_shape(model))


def release_parameters(folder: Path) -> int | None:
    """The causal LM's parameters in a folder of safetensors in Qwen3.5's release layout, from the files' headers
    (transformers builds the same count from the config, but takes seconds to import): the language model and
    its head, without the MTP head (`mtp.*`) and the vision tower (`model.visual.*`), which the causal LM does
    not hold. None for any other folder."""
    import json
    import math
    import struct

    shapes = {}
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        with file.open("rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        shapes.update({name: entry["shape"] for name, entry in header.items() if name != "__metadata__"})
    if not any(name.startswith("model.language_model.") for name in shapes):
        return None
    return sum(math.prod(shape) for name, shape in shapes.items() if not name.startswith(("mtp.", "model.visual.")))


# What the project's GPU runs of vLLM needed beyond the matrix (environments v0.26.0-h200, v0.31.0-*, v0.32.0-*: a
# wheelhouse without flashinfer), and why: (section of the environment file, key, value, why).
GPU_OVERRIDES = (
    ("engine", "gdn_prefill_backend", "triton", "on Hopper vLLM picks FlashInfer's GDN prefill, and without flashinfer "
     "installed the engine fails to start"),
    ("engine_environment", "VLLM_USE_FLASHINFER_SAMPLER", "0", "vLLM's sampler would use flashinfer; 0 keeps its own"),
)
VLLM_CHAPTERS = ("reproduce", "guidance")


def override_lines(chapter: str, environment: dict) -> list[str]:
    """For a chapter that runs vLLM on a GPU, each override of GPU_OVERRIDES the environment file omits, with why."""
    if chapter not in VLLM_CHAPTERS or not environment["hardware"].get("gpu"):
        return []
    return [f"environment {environment['id']} sets no {key} under {section}: the project's GPU runs needed "
            f"{key}: {value!r} ({why}); add it to environments/{environment['id']}.yaml unless flashinfer is installed"
            for section, key, value, why in GPU_OVERRIDES if key not in (environment.get(section) or {})]


def check(chapter: str, environment: dict, parameters: dict, *, strict: bool = False) -> list[str]:
    """What this host has, as lines to print; a UsageError naming every mismatch with the environment or
    shortage of memory. `parameters`: the run's (defaults filled in). A driver other than the environment's
    is a line of information, or a mismatch when `strict` (SPECTIE_STRICT_HOST=1 for `make run`)."""
    found = gpus()
    device = str(parameters.get("device", "cuda" if environment["hardware"].get("gpu") else "cpu"))
    if found:
        lines = [f"GPU: {len(found)} x {found[0].name}, driver {found[0].driver}, "
                 f"{found[0].free / GIB:.1f} of {found[0].total / GIB:.1f} GiB free on the first"]
    else:
        lines = ["GPU: none (nvidia-smi reports no NVIDIA GPU)"]
    problems = _gpu_problems(environment, found, device, "device" in parameters)
    for said, is_problem in (_driver(environment, found, strict),
                             _memory(chapter, parameters.get("model"), found, device)):
        if said:
            (problems if is_problem else lines).append(said)
    if problems:
        raise UsageError("this host does not fit the run:\n  " + "\n  ".join(problems + lines))
    return lines + override_lines(chapter, environment)


def _gpu_problems(environment: dict, found: list, device: str, device_given: bool) -> list[str]:
    """Where this host's GPUs (or their absence) and the run's device do not match the environment."""
    from spectie.records.fingerprint import LAST_GPU_PROBE_FAILURE

    hardware, env_id = environment["hardware"], environment["id"]
    expected, count = hardware.get("gpu"), hardware.get("gpu_count")
    problems = []
    if expected and not found:
        problems.append(f"environment {env_id!r} is a {expected} host, but this host has no NVIDIA GPU"
                        + (f" ({LAST_GPU_PROBE_FAILURE[0]})" if LAST_GPU_PROBE_FAILURE else "")
                        + "; run with ENV=cpu, or on the host the environment describes")
    elif expected and expected.lower() not in found[0].name.lower():
        problems.append(f"environment {env_id!r} is a {expected} host, but this host's GPU is {found[0].name}; "
                        "give the environment of this host, or describe it in a new environments/<id>.yaml")
    if not expected and device.startswith("cuda"):
        problems.append(f"device {device!r}: environment {env_id!r} has no GPU, so GPU records would be labelled "
                        "as a CPU run; give the environment of this GPU host (make list)")
    if expected and device_given and not device.startswith("cuda"):
        problems.append(f"device {device!r}: environment {env_id!r} is a {expected} host, so records computed on "
                        "this host's CPU would be labelled as that GPU's; give DEVICE=cuda (or ENV=cpu)")
    if device.startswith("cuda") and not found:
        problems.append(f"device {device!r}, but this host has no NVIDIA GPU; use device: cpu")
    if expected and found and count and len(found) < count:
        problems.append(f"environment {env_id!r} has {count} GPUs, this host {len(found)}")
    return problems


def _driver(environment: dict, found: list, strict: bool) -> tuple[str | None, bool]:
    """A driver other than the environment names: (what to say, whether it is a problem), or (None, False)."""
    driver, env_id = environment["hardware"].get("driver"), environment["id"]
    if not (environment["hardware"].get("gpu") and found and driver and str(driver) != found[0].driver):
        return None, False
    if strict:
        return (f"environment {env_id!r} names driver {driver}, this host has {found[0].driver} "
                "(strict host check: SPECTIE_STRICT_HOST=1)"), True
    return (f"environment {env_id!r} names driver {driver} (reported), this host has {found[0].driver}: recorded, "
            "not enforced"), False


def _memory(chapter: str, model, found: list, device: str) -> tuple[str | None, bool]:
    """What the model needs against what is free where it will live: (the line, or the problem), or (None, False)."""
    if model is None:
        return None, False
    dtype = MODEL_DTYPE.get(chapter, "float32")
    need = memory_needed(str(model), dtype)
    free, where = memory.free("cuda" if chapter == "reproduce" else device, found)  # vLLM serves on the GPU
    why = memory.shortfall(model, need, dtype, free, where)
    if why:
        return why, True
    return f"model: {model}, needs about {need / GIB:.1f} GiB in {dtype}; {free / GIB:.1f} GiB {where}", False
