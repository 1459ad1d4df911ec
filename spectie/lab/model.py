"""Loading models and running them: the one place that knows devices, dtypes, model names and kernels.

A model is `organism` (the pinned tiny Qwen3.5 model, unpacked by make setup), a local folder, or a hub
id (owner/name; used only when given). Every chapter loads its models through `load_model`, with TF32
off, so that an "fp32" forward is a true fp32 reference; `reference_gdn_kernels` makes Qwen3.5's Gated
DeltaNet layers run transformers' torch reference code instead of the Triton kernels.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from spectie.records.errors import UsageError


DTYPES = ("float64", "float32", "bfloat16", "float16")
SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return getattr(torch, name)


def check_device(device: str) -> str:
    import torch

    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!r} requested but this host has no CUDA GPU (torch sees none)")
        return device
    raise UsageError(f"unknown device {device!r}; use 'cpu' or 'cuda'")


def resolve_model(model: str) -> str:
    """`organism` (built by make setup), a local folder as an absolute path, or a hub id (owner/name)."""
    if model == "organism":
        from spectie.records.paths import organism_dir

        if not (organism_dir() / "model.safetensors").is_file():
            raise UsageError(f"the organism is not built ({organism_dir()}): run `make setup`")
        return str(organism_dir())
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"model folder {model!r} has no config.json")
        return str(path.resolve())
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return model  # a hub id: used only when given, and downloaded by transformers
    raise UsageError(f"model {model!r} is neither a folder with a config.json nor a hub id like Qwen/Qwen3.5-2B")


def check_causal_lm(model: str, config) -> None:
    """Fail early, from the config alone, unless transformers maps the model to a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"model {model!r} (model_type {config.model_type!r}) is not a causal language model")


def parameter_count(config) -> int:
    """Parameters of the causal LM a config describes (a tied head counted once), built on the meta
    device: no weights are loaded or allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update")


@contextmanager
def reference_gdn_kernels():
    """Within this block, Qwen3.5's GDN layers run transformers' torch reference code.

    transformers routes the gated delta rule and the short convolution to flash-linear-attention and
    causal-conv1d when they are installed (on GPUs); their Triton dots use TF32 by default, so an "fp32"
    forward through them is not a true fp32 reference. The reference functions sit under the wrappers
    (`__wrapped__`); this swaps them in and restores the wrappers afterwards.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    saved = {name: getattr(module, name) for name in GDN_FUNCTIONS}
    try:
        for name, function in saved.items():
            setattr(module, name, inspect.unwrap(function))
        yield
    finally:
        for name, function in saved.items():
            setattr(module, name, function)


def load_model(model: str, dtype: str, device: str = "cpu"):
    """Load a causal LM in `dtype` with a true-precision setup (TF32 off)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # from_pretrained(dtype=...) keeps RoPE's inv_freq buffer in fp32 (model.to(bf16) would not).
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype(dtype))
    return loaded.to(device).eval()


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (an EOS token) or "length"

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def position(self, i: int) -> int:
        """Sequence position of the i-th output token (0-based i)."""
        return len(self.prompt_ids) + i


def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> Generation:
    """Greedy decoding token by token with the cache (GDN's recurrent rule), stopping at EOS."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_ids, pad_token_id=eos_ids[0], attention_mask=None,
        )
    output = out[0, len(prompt_ids):].tolist()
    if output and output[-1] in eos_ids:
        return Generation(list(prompt_ids), output, "stop")
    return Generation(list(prompt_ids), output, "length")


def teacher_forced_logits(model, ids: list[int], positions: list[int]):
    """Logits (float64, on CPU) predicting the tokens at `positions`, from ONE forward over `ids`.

    The output head runs only on the needed rows: for Qwen3.5's 248k vocabulary that is most of the
    cost of a full-sequence head.
    """
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0]
        rows = hidden[torch.tensor([p - 1 for p in positions], device=device)]
        return model.lm_head(rows).double().cpu()


def stepwise_logits(model, ids: list[int], positions: list[int]):
    """The same logits computed token by token with the cache (slow; for tests and checks)."""
    import torch

    device = next(model.parameters()).device
    wanted = {p - 1: i for i, p in enumerate(positions)}
    result = [None] * len(positions)
    with torch.no_grad():
        first = min(wanted)
        out = model(input_ids=torch.tensor([ids[:first + 1]], device=device), use_cache=True)
        result[wanted[first]] = out.logits[0, -1].double().cpu()
        cache = out.past_key_values
        for index in range(first + 1, max(wanted) + 1):
            out = model(input_ids=torch.tensor([[ids[index]]], device=device), past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            if index in wanted:
                result[wanted[index]] = out.logits[0, -1].double().cpu()
    return torch.stack(result)
