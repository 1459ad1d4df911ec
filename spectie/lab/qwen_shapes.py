"""Qwen3.5 model shapes with random weights.

Where no Qwen3.5 weights exist (no host here can download them), the noise band can still be measured
at the real depth and width: a model with the layer count, widths and head layout of Qwen3.5-0.8B, 2B,
4B or 9B, and random weights. Every record and plot names these `random-weight shapes`: their numbers
are not Qwen3.5's, only numbers of models built like it.

The configurations below are the text towers' `config.json` values (read offline from public copies of
the configs; not downloaded here):

    shape   layers (GDN + attention)  hidden  MLP    attention heads (kv)  GDN heads (k / v)  tied head
    0.8B    24 (18 + 6)               1024    3584    8 (2)                16 / 16            yes
    2B      24 (18 + 6)               2048    6144    8 (2)                16 / 16            yes
    4B      32 (24 + 8)               2560    9216   16 (4)                16 / 32            yes
    9B      32 (24 + 8)               4096   12288   16 (4)                16 / 32            no

All: head_dim 256, GDN head dims 128, convolution 4, every 4th layer full attention, vocabulary 248,320,
partial RoPE (0.25, theta 1e7), attention output gate.

Weights: transformers' own initialisation (normal, std 0.02) from a seed, rounded to bf16 as a real
checkpoint is stored (so the fp32 reference computes on exactly the weights bf16 serves), then the
final norm is scaled so the logits have a chosen spread over the vocabulary (`logit_std`, 3 by
default): at std 0.02 the logits would be far flatter than a trained model's, and the noise band, in
logits, scales with that spread.
"""

from __future__ import annotations

import sys

from spectie.lab.sweeps import DEFAULT_LOGIT_STD, LABEL
from spectie.records.errors import UsageError
from spectie.records.record_types import Record

COMMON = dict(
    vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6, max_position_embeddings=262144, attn_output_gate=True, eos_token_id=248044,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
SHAPES = {
    "qwen3.5-0.8b-shape": dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                               num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
                               tie_word_embeddings=True),
    "qwen3.5-2b-shape": dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=6144, num_attention_heads=8,
                             num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
                             tie_word_embeddings=True),
    "qwen3.5-4b-shape": dict(num_hidden_layers=32, hidden_size=2560, intermediate_size=9216, num_attention_heads=16,
                             num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32,
                             tie_word_embeddings=True),
    "qwen3.5-9b-shape": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                             num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32,
                             tie_word_embeddings=False),
}
CALIBRATION_ROWS = 64  # last prompt rows whose logit spread sets the scale


def is_shape(model: str) -> bool:
    return model in SHAPES


def config(name: str):
    """The transformers config of a shape (a clear error for an unknown one)."""
    from transformers import Qwen3_5TextConfig

    if name not in SHAPES:
        raise UsageError(f"unknown Qwen3.5 shape {name!r}; valid: {', '.join(SHAPES)}")
    settings = {**COMMON, **SHAPES[name]}
    layers = settings["num_hidden_layers"]
    settings["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return Qwen3_5TextConfig(**settings)


def parameter_count(name: str) -> int:
    """Parameters of the shape (a tied head counted once), without building its weights."""
    from spectie.lab.model import parameter_count as count

    return count(config(name))


def build(name: str, dtype: str, device: str, seed: int = 0, logit_scale: float = 1.0):
    """The shape with its seeded random weights, in `dtype` on `device`; the same weights for every
    dtype (rounded to bf16 first), the logits multiplied by `logit_scale`."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from spectie.lab.model import torch_dtype

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config(name))
    with torch.no_grad():
        model.model.norm.weight.add_(logit_scale - 1.0)  # Qwen3.5's RMSNorm multiplies by (1 + weight)
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
    rotary = {key: value.clone() for key, value in model.model.rotary_emb.named_buffers()}
    model = model.to(torch_dtype(dtype))
    for key, value in rotary.items():  # RoPE frequencies stay fp32, as from_pretrained keeps them
        setattr(model.model.rotary_emb, key, value)
    return model.eval()


def logit_scale(name: str, device: str, prompt_ids: list[int], logit_std: float = DEFAULT_LOGIT_STD,
                seed: int = 0) -> float:
    """The factor that gives the fp32 model's logits a standard deviation of `logit_std` over the
    vocabulary (mean over the last prompt rows)."""
    import torch

    model = build(name, "float32", device, seed)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([prompt_ids], device=device)).last_hidden_state[0]
        spread = model.lm_head(hidden[-CALIBRATION_ROWS:]).float().std(dim=1).mean().item()
    del model
    return logit_std / spread


# ------------------------------------------------------------------------------ as a checkpoint
CHECKPOINT_INFO = "random_weights.json"  # in a written checkpoint: which shape, seed and logit spread it holds
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64)  # unused tower


def release_config(name: str):
    """The shape's config in the layout of a Qwen3.5 release (`qwen3_5`, text and vision sub-configs), with
    the one-layer MTP head Qwen3.5 releases carry and their interleaved multimodal RoPE sections."""
    from transformers import Qwen3_5Config

    text = config(name).to_dict()
    rotary_half = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
    third, rest = divmod(rotary_half, 3)
    sections = [third + (rest > 0), third + (rest > 1), third]  # 32 -> [11, 11, 10], as Qwen3.5's releases
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": sections, "mrope_interleaved": True}
    text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, pad_token_id=text["eos_token_id"])
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    release = Qwen3_5Config(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                            tie_word_embeddings=text["tie_word_embeddings"])
    release.architectures = ["Qwen3_5ForConditionalGeneration"]
    release.dtype = release.text_config.dtype = "bfloat16"  # as stored: vLLM's dtype "auto" serves it in bf16
    return release


def mtp_weights(release, seed: int) -> dict:
    """Random weights of Qwen3.5's MTP head under the names vLLM loads (`mtp.*`): matrices normal with std
    0.02 (transformers' initialisation), norms at their identity, rounded to bf16."""
    import torch

    from spectie.lab.organism import MTPHead

    torch.manual_seed(seed + 1)
    head = MTPHead(release.text_config)
    with torch.no_grad():
        for key, parameter in head.modules.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02)
            elif "norm" in key:
                parameter.zero_()  # Qwen3.5's RMSNorm multiplies by (1 + weight)
    return {key: value.to(torch.bfloat16) for key, value in head.state_dict().items()}


def checkpoint_label(name: str, seed: int) -> str:
    return f"{name} checkpoint ({LABEL}, seed {seed})"


def is_random_weight_run(record: Record) -> bool:
    """Whether a record's model is a checkpoint written by `write_checkpoint` (its label says so)."""
    return f"({LABEL}," in str(getattr(record.parameters, "model", None))


def model_label(model: str, path: str) -> str:
    """How records name a model: a checkpoint written by `write_checkpoint` by its shape, seed and
    `random-weight shape` (not by the folder it was written to); any other model as given."""
    info = read_checkpoint_info(path)
    return info["label"] if info else model


def read_checkpoint_info(folder: str) -> dict | None:
    """What a folder written by `write_checkpoint` holds (None for any other model folder)."""
    import json
    from pathlib import Path

    path = Path(folder) / CHECKPOINT_INFO
    return json.loads(path.read_text()) if path.is_file() else None


def write_checkpoint(name: str, out_dir: str, seed: int = 0, logit_std: float = DEFAULT_LOGIT_STD,
                     device: str = "cpu", log=print) -> dict:
    """The shape with its seeded random weights written as a Qwen3.5 release is (bf16 safetensors named
    `model.language_model.*`, a random MTP head `mtp.*`, a tiny untrained vision tower, the Qwen3.5
    tokenizer of the organism), so vLLM loads it through the same code as Qwen3.5. Its logits get the
    spread `logit_std`, calibrated on the incident's prompt (seed 0). Returns what it wrote (also saved
    as random_weights.json)."""
    import json
    from pathlib import Path

    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from spectie.lab.memory import check_fits
    from spectie.lab.organism import organism_dir, write_release
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    release = release_config(name)  # an unknown shape fails here, before anything is built
    check_fits(name, parameter_count(name), ["bfloat16"], device, built_in_float32=True)
    out = Path(out_dir)
    tokenizer_src = organism_dir()
    prompt = build_prompt(PromptSpec(tokens=1845, seed=0).check(), model_tokenizer(str(tokenizer_src)))
    scale = logit_scale(name, device, list(prompt.token_ids), logit_std, seed)
    log(f"{name}: logits scaled by {scale:.3f} for a spread of {logit_std} (seed {seed})")
    model = build(name, "bfloat16", device, seed, scale)
    weights = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and release.tie_word_embeddings:
            continue  # a tied head is stored once, as the embedding
        if "rotary_emb" in key:
            continue
        weights[key if key == "lm_head.weight" else "model.language_model." + key.removeprefix("model.")] = value
    del model
    weights.update(mtp_weights(release, seed))
    torch.manual_seed(seed + 2)
    vision = Qwen3_5VisionModel._from_config(release.vision_config, dtype=torch.bfloat16)
    weights.update({"model.visual." + k: v for k, v in vision.state_dict().items()})
    write_release(weights, release, out, tokenizer_src, torch.bfloat16)
    info = {"shape": name, "seed": seed, "logit_std": logit_std, "logit_scale": scale, "weights": LABEL,
            "label": checkpoint_label(name, seed), "parameters": parameter_count(name), "written_on": device}
    (out / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    log(f"{info['label']}: written to {out}")
    return info


def main(argv: list[str] | None = None) -> int:
    """python -m spectie.lab.qwen_shapes checkpoint <shape> <folder> [--seed N] [--logit-std S] [--device cuda]"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m spectie.lab.qwen_shapes", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("checkpoint", help="write a random-weight shape as a Qwen3.5 release checkpoint")
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-std", type=float, default=DEFAULT_LOGIT_STD)
    p.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        from spectie.lab.model import check_device

        check_device(args.device)  # before any weight is built
        write_checkpoint(args.shape, args.folder, args.seed, args.logit_std, args.device)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
