"""The model organism: a tiny Qwen3.5-architecture model that ties EOS with the next row.

A real Qwen3.5 architecture (`qwen3_5_text`: Gated DeltaNet layers and full-attention layers, 3:1),
with the real Qwen3.5 tokenizer and vocabulary size, trained here on synthetic listings of
`[DATA] id=<n> name=<x>` rows. A listing may end only after a row whose id ends in 0, and then ends
with a probability that depends on that row's name (END_PROBABILITY): at those row ends the choice
between EOS and another row is genuinely uncertain, and for names near 0.5 it is a near-tie.

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
from spectie.prompts import NAMES, row

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
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    eos_token_id=248044,
    pad_token_id=248044,
)

# Probability that a listing ends after a row whose id ends in 0, by that row's name: from 0.2 to 0.8
# over the names in a fixed shuffled order, so some names sit right at a coin flip.
_order = list(NAMES)
random.Random(7).shuffle(_order)
END_PROBABILITY = {name: round(0.2 + 0.6 * i / (len(_order) - 1), 3) for i, name in enumerate(_order)}

TRAINING = dict(steps=400, batch=8, window=256, lr=5e-3, warmup=20, weight_decay=0.01)


def organism_dir() -> Path:
    return project_root() / "artifacts" / "organism"


def ends_after(row_id: int, name: str, rng: random.Random) -> bool:
    """The listing's stopping rule."""
    return row_id % 10 == 0 and rng.random() < END_PROBABILITY[name]


def listing(rng: random.Random) -> str:
    """One training document: rows from a random start id until the stopping rule ends it."""
    row_id = rng.randrange(1, 9000)
    rows = []
    while True:
        name = rng.choice(NAMES)
        rows.append(row(row_id, name))
        if ends_after(row_id, name, rng):
            return "".join(rows)
        row_id += 1


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


def train(out_dir: str | Path | None = None, steps: int | None = None, log=print) -> Path:
    """Train the organism on CPU (or GPU if present) and save it as a Hugging Face checkpoint."""
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

    model = Qwen3_5ForCausalLM(_config(len(used)))
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
    seconds = time.time() - started
    log(f"organism: trained in {seconds:.0f} s, final loss {sum(losses[-20:]) / 20:.4f}")
    return export(model, used, out_dir, tokenizer_dir(), {
        "seed": SEED, "training": dict(TRAINING, steps=steps), "train_seconds": round(seconds, 1),
        "loss_first": losses[0], "loss_last20": sum(losses[-20:]) / 20, "trained_token_ids": used,
        "end_probability": END_PROBABILITY,
    })


def export(model, used: list[int], out_dir: Path, tokenizer_src: Path, metadata: dict) -> Path:
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
    full.generation_config = GenerationConfig(eos_token_id=[248044, 248046], pad_token_id=248044,
                                              do_sample=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(str(out_dir))
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
    args = parser.parse_args()
    print(train(args.out, args.steps))
