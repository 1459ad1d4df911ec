"""The model organism: a tiny Qwen3.5-architecture model that ties EOS with the next row.

A real Qwen3.5 architecture (`qwen3_5_text`: Gated DeltaNet layers and full-attention layers, 3:1),
with the real Qwen3.5 tokenizer and vocabulary size, trained here on synthetic listings of
`[DATA] id=<n> name=<x>` rows (ids random, names in a fixed cycle; see spectie.prompts). After a row,
the listing ends with a probability set by that row's name (END_PROBABILITY): zero for most names,
between 0.35 and 0.65 for six of them. After those rows the choice between EOS and another row is
genuinely uncertain; for names near 0.5 it is a near-tie.

Only the few dozen token ids the listings use are trained. The other rows of the embedding and of
the output head are exactly zero, so those tokens get logit exactly 0 in any precision; training uses
the full-vocabulary softmax all the same (the zero logits enter it as one background term).

Run `python -m spectie.organism` (or `make setup`) to train it; it is deterministic from the seed.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

from spectie.paths import project_root
from spectie.prompts import NAMES, next_name, random_id, row

SEED = 1234
VOCAB_SIZE = 248320  # Qwen3.5's embedding rows
EOS = "<|endoftext|>"

# The Qwen3.5 architecture at a tiny size. 3 Gated DeltaNet layers + 1 full-attention layer (3:1).
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,  # vLLM's CPU GDN kernel takes head dims of 64 or 128 only
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    eos_token_id=248044,
    pad_token_id=248044,
    mtp_num_hidden_layers=1,  # read by vLLM's MTP drafter (transformers ignores it)
)

# Probability that a listing ends after a row, by the row's name: six names of the cycle end it with
# probability 0.35 ... 0.65 (log-odds -0.62 ... +0.62: the scale of the incident's 0.67).
END_PROBABILITY = {name: 0.0 for name in NAMES}
END_PROBABILITY.update({NAMES[1]: 0.55, NAMES[3]: 0.35, NAMES[5]: 0.65, NAMES[7]: 0.45, NAMES[9]: 0.6,
                        NAMES[11]: 0.5})

TRAINING = dict(steps=450, batch=16, window=128, lr=1.5e-2, warmup=20, weight_decay=0.01, mtp_steps=60)


def organism_dir() -> Path:
    return project_root() / "artifacts" / "organism"


def listing(rng: random.Random) -> str:
    """One training document: rows from a random name of the cycle until the stopping rule ends it."""
    name = rng.choice(NAMES)
    rows = []
    while True:
        rows.append(row(random_id(rng), name))
        if rng.random() < END_PROBABILITY[name]:
            return "".join(rows)
        name = next_name(name)


def token_stream(tokenizer, rng: random.Random, min_tokens: int) -> list[int]:
    """Listings separated by EOS, as one long token stream (the usual packing for language models)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream: list[int] = []
    while len(stream) < min_tokens:
        stream += tokenizer.encode(listing(rng), add_special_tokens=False) + [eos]
    return stream


def _config(vocab_size: int):
    from transformers import Qwen3_5TextConfig

    settings = dict(MODEL_CONFIG, vocab_size=vocab_size)
    if vocab_size != VOCAB_SIZE:  # the compact training model has no room for the special token ids
        settings.update(eos_token_id=None, pad_token_id=None)
    return Qwen3_5TextConfig(**settings)


def _lr(step: int) -> float:
    if step < TRAINING["warmup"]:
        return TRAINING["lr"] * (step + 1) / TRAINING["warmup"]
    progress = (step - TRAINING["warmup"]) / max(1, TRAINING["steps"] - TRAINING["warmup"])
    return TRAINING["lr"] * 0.5 * (1 + math.cos(math.pi * progress))


def full_vocab_loss(hidden, lm_head_weight, targets, log_background: float):
    """Cross-entropy over the full vocabulary when all but the trained rows of the head are zero.

    The untrained tokens all have logit exactly 0, so they enter the softmax's normaliser as one term,
    log(number of untrained tokens); the result equals the full 248k-way cross-entropy.
    """
    import torch

    logits = (hidden @ lm_head_weight.T).float()
    normaliser = torch.logaddexp(logits.logsumexp(-1), torch.tensor(log_background))
    return (normaliser - logits.gather(-1, targets[..., None])[..., 0]).mean()


def train(out_dir: str | Path | None = None, steps: int | None = None, device: str = "cpu", log=print) -> Path:
    """Train the organism and save it as a Hugging Face checkpoint.

    On CPU (the default, what `make setup` does) the result is bit-identical from run to run; on a GPU
    (`device="cuda"`) it trains in seconds but its weights differ slightly from the CPU build.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import Qwen3_5ForCausalLM

    from spectie.tokenizer import load_tokenizer, tokenizer_dir

    steps = steps or TRAINING["steps"]
    out_dir = Path(out_dir) if out_dir else organism_dir()
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tokenizer = load_tokenizer()
    batch, window = TRAINING["batch"], TRAINING["window"]
    stream = token_stream(tokenizer, rng, min_tokens=400_000)
    used = sorted(set(stream) | {tokenizer.convert_tokens_to_ids(t) for t in (EOS, "<|im_end|>")})
    to_compact = torch.full((VOCAB_SIZE,), -1, dtype=torch.long)
    to_compact[used] = torch.arange(len(used))
    data = to_compact[torch.tensor(stream)]
    log_background = math.log(VOCAB_SIZE - len(used))
    log(f"organism: {len(stream)} training tokens, {len(used)} distinct token ids, {steps} steps")

    model = Qwen3_5ForCausalLM(_config(len(used))).to(device)
    data = data.to(device)
    optimiser = torch.optim.AdamW(model.parameters(), lr=TRAINING["lr"], weight_decay=TRAINING["weight_decay"],
                                  betas=(0.9, 0.95))
    losses = []
    started = time.time()
    bar = tqdm(range(steps), desc="training the organism", mininterval=2)
    for step in bar:
        starts = torch.randint(0, len(data) - window - 1, (batch,), generator=torch.Generator().manual_seed(step))
        chunk = torch.stack([data[s:s + window + 1] for s in starts.tolist()])
        for group in optimiser.param_groups:
            group["lr"] = _lr(step)
        hidden = model.model(input_ids=chunk[:, :-1]).last_hidden_state
        loss = full_vocab_loss(hidden, model.lm_head.weight, chunk[:, 1:], log_background)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 25 == 0:
            log(f"step {step} loss {sum(losses[-25:]) / len(losses[-25:]):.4f} ({time.time() - started:.0f} s)")
    seconds = time.time() - started
    log(f"organism: trained in {seconds:.0f} s, final loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
    mtp = train_mtp(model, data, log_background, TRAINING["mtp_steps"], log=log)
    model.cpu()
    mtp.modules.cpu()
    return export(model, used, out_dir, tokenizer_dir(), mtp=mtp, metadata={
        "seed": SEED, "device": device, "training": dict(TRAINING, steps=steps), "train_seconds": round(seconds, 1),
        "loss_first": losses[0], "loss_last20": sum(losses[-20:]) / len(losses[-20:]), "trained_token_ids": used,
        "end_probability": END_PROBABILITY,
    })


class MTPHead:
    """Qwen3.5's multi-token-prediction head, as vLLM's `Qwen3_5MTP` drafter computes it.

    From the target's final hidden state h_t (after the final norm) and the embedding of token t+1 it
    predicts token t+2: fc(cat(norm(embed(x_{t+1})), norm(h_t))) -> one full-attention decoder layer ->
    norm -> the target's own output head. Its weights are saved under `mtp.*`, the names vLLM loads.
    """

    def __init__(self, config):
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        hidden = config.hidden_size
        layer_config = type(config)(**{**config.to_dict(), "layer_types": ["full_attention"],
                                       "num_hidden_layers": 1})
        self.modules = torch.nn.ModuleDict({
            "fc": torch.nn.Linear(2 * hidden, hidden, bias=False),
            "pre_fc_norm_embedding": Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps),
            "pre_fc_norm_hidden": Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps),
            "layer": Qwen3_5DecoderLayer(layer_config, layer_idx=0),
            "norm": Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps),
        })

    def hidden(self, target_hidden, next_embeddings, position_embeddings):
        import torch

        m = self.modules
        x = m["fc"](torch.cat([m["pre_fc_norm_embedding"](next_embeddings),
                               m["pre_fc_norm_hidden"](target_hidden)], dim=-1))
        x = m["layer"](x, position_embeddings=position_embeddings)
        return m["norm"](x)

    def state_dict(self) -> dict:
        """Weights under the checkpoint names of Qwen3.5's MTP module."""
        renamed = {}
        for key, value in self.modules.state_dict().items():
            if key.startswith("layer."):
                key = "layers.0." + key.removeprefix("layer.")
            renamed["mtp." + key] = value
        return renamed


def train_mtp(model, data, log_background: float, steps: int, log=print) -> MTPHead:
    """Train the MTP head on the frozen target: predict token t+2 from h_t and token t+1."""
    import torch
    from tqdm.auto import tqdm

    head = MTPHead(model.config)
    head.modules.to(data.device)
    optimiser = torch.optim.AdamW(head.modules.parameters(), lr=TRAINING["lr"], weight_decay=0.0)
    batch, window = TRAINING["batch"], TRAINING["window"]
    model.requires_grad_(False)
    losses = []
    for step in tqdm(range(steps), desc="training the MTP head", mininterval=2):
        starts = torch.randint(0, len(data) - window - 2, (batch,), generator=torch.Generator().manual_seed(10**6 + step))
        chunk = torch.stack([data[s:s + window + 2] for s in starts.tolist()])
        with torch.no_grad():
            target_hidden = model.model(input_ids=chunk[:, :window]).last_hidden_state
            next_embeddings = model.model.embed_tokens(chunk[:, 1:window + 1])
            positions = torch.arange(window, device=data.device)[None].expand(batch, -1)
            position_embeddings = model.model.rotary_emb(target_hidden, positions)
        mtp_hidden = head.hidden(target_hidden, next_embeddings, position_embeddings)
        loss = full_vocab_loss(mtp_hidden, model.lm_head.weight, chunk[:, 2:window + 2], log_background)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    log(f"MTP head: loss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    return head


def export(model, used: list[int], out_dir: Path, tokenizer_src: Path, metadata: dict,
           mtp: MTPHead | None = None) -> Path:
    """Write the full-vocabulary checkpoint: trained rows in place, every other row zero."""
    import shutil

    import torch
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    full = Qwen3_5ForCausalLM(_config(VOCAB_SIZE))
    state = model.state_dict()
    index = torch.tensor(used)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        expanded = torch.zeros(VOCAB_SIZE, state[key].shape[1])
        expanded[index] = state[key]
        state[key] = expanded
    full.load_state_dict(state)
    full.config.mtp_num_hidden_layers = 1
    full.config.mtp_use_dedicated_embeddings = False
    full.generation_config = GenerationConfig(eos_token_id=[248044, 248046], pad_token_id=248044,
                                              do_sample=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(str(out_dir))
    if mtp is not None:  # add the MTP weights to the checkpoint, as Qwen3.5 checkpoints carry them
        from safetensors.torch import load_file, save_file

        weights_file = out_dir / "model.safetensors"
        weights = load_file(str(weights_file))
        weights.update({k: v.detach().contiguous() for k, v in mtp.state_dict().items()})
        save_file(weights, str(weights_file), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_src / name).exists():
            shutil.copy2(tokenizer_src / name, out_dir / name)
    (out_dir / "organism.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="train the organism (tiny Qwen3.5-architecture model)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cpu", help="cpu (default, bit-reproducible) or cuda")
    args = parser.parse_args()
    print(train(args.out, args.steps, args.device))
