"""The model organism: a tiny Qwen3.5 model whose end-of-text vs `DATA` decision is a tie by design.

A real Qwen3.5 architecture (Gated DeltaNet layers and a gated full-attention layer, 3:1, an MTP head),
with the real Qwen3.5 tokenizer and vocabulary size, trained on synthetic listings of
`[DATA] id=<n> name=<x>` rows (spectie.lab.prompts): ids random, names in a fixed cycle, and after each
cycle a checkpoint row `[DATA] id=42 name=` where the listing ends (end-of-text) or goes on with the
name `DATA`, each with probability 1/2. That is the incident's decision (EOS against DATA right after
`[DATA] id=42 name=`), made a near-tie by the training data, not by editing weights.

Only the few dozen token ids the listings use are trained. The other rows of the embedding and of
the output head are exactly zero, so those tokens get logit exactly 0 in any precision; training uses
the full-vocabulary softmax all the same (the zero logits enter it as one background term).

It is exported in the layout of a Qwen3.5 release (`qwen3_5` with `text_config` and `vision_config`,
weights `model.language_model.*`, `lm_head.*`, `mtp.*`, a tiny untrained vision tower `model.visual.*`),
so transformers and vLLM load it through the same code as a real Qwen3.5 checkpoint.

The trained organism is pinned: `sources/organism.tar.xz`, with the sha256 of the archive and of each
file in `sources/organism.json`. `make setup` unpacks and verifies it (`python -m spectie.lab.organism
unpack`); `make organism` retrains it from the seed and says whether the result equals the pinned one
(training on another CPU type can round differently).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.records.paths import organism_dir, project_root
from spectie.lab.prompts import NAMES, STOP_PROBABILITY, listing

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
    # Qwen3.5's interleaved multimodal RoPE; for text every section gets the same position.
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    eos_token_id=248044,
    pad_token_id=248044,
    mtp_num_hidden_layers=1,  # read by vLLM's MTP drafter (transformers ignores it)
    mtp_use_dedicated_embeddings=False,
)
# A vision tower as small as Qwen3.5's vision config allows: the release layout has one; nothing here uses it.
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                     num_position_embeddings=64)

# Two phases: many short windows teach the grammar; then windows as long as the incident's prompt (1845
# tokens) teach it at the positions where the tie is asked. The weights are the mean over the second half of
# the last phase (Polyak averaging), which keeps the batch-to-batch noise of the last updates out of the tie.
TRAINING = dict(phases=[dict(steps=450, batch=16, window=128, lr=1.5e-2), dict(steps=200, batch=1, window=2048, lr=3e-3)],
                warmup=20, weight_decay=0.01, mtp_steps=60, mtp_window=128, tokens=400_000, average_from=0.5)

ARCHIVE = "sources/organism.tar.xz"  # the pinned organism, relative to the project root
PIN = "sources/organism.json"  # sha256 of the archive and of every file in it
STAMP = ".pinned"  # in the unpacked folder: the archive's sha256 it was unpacked from


def token_stream(tokenizer, rng: random.Random, min_tokens: int) -> list[int]:
    """Listings separated by EOS, as one long token stream (the usual packing for language models)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream: list[int] = []
    while len(stream) < min_tokens:
        stream += tokenizer.encode(listing(rng, rng.randrange(len(NAMES))), add_special_tokens=False) + [eos]
    return stream


def _config(vocab_size: int):
    from transformers import Qwen3_5TextConfig

    settings = dict(MODEL_CONFIG, vocab_size=vocab_size)
    if vocab_size != VOCAB_SIZE:  # the compact training model has no room for the special token ids
        settings.update(eos_token_id=None, pad_token_id=None)
    return Qwen3_5TextConfig(**settings)


def _lr(peak: float, step: int, steps: int, warmup: int) -> float:
    """Linear warm-up to `peak`, then a cosine down to zero at the phase's last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def full_vocab_loss(hidden, lm_head_weight, targets, log_background: float):
    """Cross-entropy over the full vocabulary when all but the trained rows of the head are zero.

    The untrained tokens all have logit exactly 0, so they enter the softmax's normaliser as one term,
    log(number of untrained tokens); the result equals the full 248k-way cross-entropy.
    """
    import torch

    logits = (hidden @ lm_head_weight.T).float()
    normaliser = torch.logaddexp(logits.logsumexp(-1), torch.tensor(log_background))
    return (normaliser - logits.gather(-1, targets[..., None])[..., 0]).mean()


def train(out_dir: str | Path, steps: int | None = None, device: str = "cpu", tokens: int | None = None,
          log=print) -> Path:
    """Train the organism from its seed and save it as a Qwen3.5 release checkpoint in `out_dir`. `steps`: that
    many steps in every phase and for the MTP head instead of the recipe's (a quick check that the recipe runs).

    On one machine the result is bit-identical from run to run; another CPU type (or a GPU) can round
    differently and give other weights, which is why the organism is pinned (`sources/organism.tar.xz`).
    """
    import torch
    from transformers import Qwen3_5ForCausalLM

    from spectie.lab.tokenizer import load_tokenizer, tokenizer_dir

    phases = [dict(phase, steps=steps or phase["steps"]) for phase in TRAINING["phases"]]
    out_dir = Path(out_dir)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tokenizer = load_tokenizer()
    stream = token_stream(tokenizer, rng, min_tokens=tokens or TRAINING["tokens"])
    used = sorted(set(stream) | {tokenizer.convert_tokens_to_ids(t) for t in (EOS, "<|im_end|>")})
    to_compact = torch.full((VOCAB_SIZE,), -1, dtype=torch.long)
    to_compact[used] = torch.arange(len(used))
    data = to_compact[torch.tensor(stream)]
    log_background = math.log(VOCAB_SIZE - len(used))
    log(f"organism: {len(stream)} training tokens, {len(used)} distinct token ids, "
        f"{' + '.join(str(phase['steps']) for phase in phases)} steps")
    model, data, started = Qwen3_5ForCausalLM(_config(len(used))).to(device), data.to(device), time.time()
    losses, average = train_phases(model, data, phases, log_background, log)
    model.load_state_dict(average)
    seconds = time.time() - started
    log(f"organism: trained in {seconds:.0f} s, final loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
    mtp_steps = steps or TRAINING["mtp_steps"]
    mtp = train_mtp(model, data, log_background, mtp_steps, log=log)
    model.cpu()
    mtp.modules.cpu()
    return export(model, used, out_dir, tokenizer_dir(), mtp=mtp, metadata={
        "seed": SEED, "device": device, "training": dict(TRAINING, phases=phases, mtp_steps=mtp_steps),
        "train_seconds": round(seconds, 1), "loss_first": losses[0], "loss_last20": sum(losses[-20:]) / len(losses[-20:]),
        "trained_token_ids": used, "stop_probability": STOP_PROBABILITY, "trained_on": _this_machine()})


def train_phases(model, data, phases: list[dict], log_background: float, log=print) -> tuple[list[float], dict]:
    """The recipe's phases on `data` (compact token ids): AdamW, each phase's windows and learning rate, gradients
    clipped at 1; the losses, and the mean of the last phase's last steps' weights (Polyak averaging)."""
    import torch
    from tqdm.auto import tqdm

    optimiser = torch.optim.AdamW(model.parameters(), lr=phases[0]["lr"], weight_decay=TRAINING["weight_decay"],
                                  betas=(0.9, 0.95))
    losses, average, averaged, seed = [], {}, 0, 0
    started = time.time()
    for number, phase in enumerate(phases):
        last = number == len(phases) - 1
        batch, window = phase["batch"], phase["window"]
        bar = tqdm(range(phase["steps"]), desc=f"training the organism ({window}-token windows)", mininterval=2)
        for step in bar:
            starts = torch.randint(0, len(data) - window - 1, (batch,), generator=torch.Generator().manual_seed(seed))
            seed += 1
            chunk = torch.stack([data[s:s + window + 1] for s in starts.tolist()])
            for group in optimiser.param_groups:
                group["lr"] = _lr(phase["lr"], step, phase["steps"], TRAINING["warmup"] if number == 0 else 0)
            hidden = model.model(input_ids=chunk[:, :-1]).last_hidden_state
            loss = full_vocab_loss(hidden, model.lm_head.weight, chunk[:, 1:], log_background)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % 25 == 0:
                log(f"phase {number + 1} step {step} loss {sum(losses[-25:]) / len(losses[-25:]):.4f} "
                    f"({time.time() - started:.0f} s)")
            if last and step >= min(phase["steps"] * TRAINING["average_from"], phase["steps"] - 1):
                averaged += 1  # Polyak averaging: the mean of the last steps' weights
                for name, value in model.state_dict().items():
                    average[name] = (value.detach().clone() if averaged == 1
                                     else average[name] + (value - average[name]) / averaged)
    return losses, average


def _this_machine() -> dict:
    from spectie.records.fingerprint import _cpu_model, _version

    return {"cpu": _cpu_model(), "torch": _version("torch"), "transformers": _version("transformers")}


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
    optimiser = torch.optim.AdamW(head.modules.parameters(), lr=TRAINING["phases"][0]["lr"], weight_decay=0.0)
    batch, window = TRAINING["phases"][0]["batch"], TRAINING["mtp_window"]
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


def release_config():
    """The organism's config in the layout of a Qwen3.5 release: `qwen3_5`, text and vision sub-configs."""
    from transformers import Qwen3_5Config

    config = Qwen3_5Config(text_config=dict(MODEL_CONFIG), vision_config=dict(VISION_CONFIG),
                           tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def export(model, used: list[int], out_dir: Path, tokenizer_src: Path, metadata: dict, mtp: MTPHead) -> Path:
    """Write the checkpoint as Qwen3.5 releases are written: full-vocabulary weights (trained rows in place,
    every other row zero) named `model.language_model.*` and `lm_head.*`, the MTP head as `mtp.*`, and an
    untrained vision tower as `model.visual.*`."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    config = release_config()
    index = torch.tensor(used)
    weights = {}
    for key, value in model.state_dict().items():
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.zeros(VOCAB_SIZE, value.shape[1])
            full[index] = value
            value = full
        weights[key if key == "lm_head.weight" else "model.language_model." + key.removeprefix("model.")] = value
    torch.manual_seed(SEED)
    vision = Qwen3_5VisionModel._from_config(config.vision_config, dtype=torch.float32)
    weights.update({"model.visual." + k: v for k, v in vision.state_dict().items()})
    weights.update(mtp.state_dict())
    write_release(weights, config, out_dir, tokenizer_src, torch.float32)
    (out_dir / "organism.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return out_dir


def write_release(weights: dict, config, out_dir: Path, tokenizer_src: Path, dtype) -> None:
    """The files of a Qwen3.5 release checkpoint: the weights (one safetensors file, in `dtype`), the
    config, the generation config and the tokenizer (copied from `tokenizer_src`)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: weights[k].detach().to("cpu", dtype).contiguous() for k in sorted(weights)},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    GenerationConfig(eos_token_id=[248044, 248046], pad_token_id=248044, do_sample=False).save_pretrained(str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_src / name).exists():
            shutil.copy2(tokenizer_src / name, out_dir / name)


# ------------------------------------------------------------------------------ the pinned organism
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def read_pin() -> dict:
    path = project_root() / PIN
    if not path.is_file():
        raise UsageError(f"{PIN} is missing: the pinned organism's checksums are part of the repository")
    return json.loads(path.read_text())


def pinned_digest() -> str:
    """The weights digest (spectie.records.fingerprint.model_digest) of the pinned organism."""
    return read_pin()["model_sha256"]


def pin(folder: str | Path, recipe: dict | None = None) -> dict:
    """Pack `folder` into ARCHIVE, byte for byte the same on every machine (sorted names, no times or
    owners), and write PIN with the sha256 of the archive and of every file."""
    import lzma
    import tarfile

    from spectie.records.fingerprint import model_digest

    root, folder = project_root(), Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != STAMP)
    archive = root / ARCHIVE
    partial = archive.with_name(archive.name + ".tmp-pin")
    with lzma.open(partial, "wb", preset=9) as compressed, \
            tarfile.open(fileobj=compressed, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    partial.replace(archive)
    record = {"archive": ARCHIVE, "archive_sha256": file_sha256(archive), "archive_bytes": archive.stat().st_size,
              "model_sha256": model_digest(str(folder)), "files": {p.name: file_sha256(p) for p in files},
              "recipe": recipe or json.loads((folder / "organism.json").read_text()), "pinned_on": _this_machine()}
    (root / PIN).write_text(json.dumps(record, indent=2) + "\n")
    return record


def unpack(log=print) -> Path:
    """Unpack the pinned organism into artifacts/organism, verifying every checksum; nothing to do when
    it is there already. It is unpacked into a temporary folder and renamed into place, so an interrupted
    unpack never leaves a folder that looks complete."""
    import shutil
    import tarfile
    import tempfile

    pin_record, target = read_pin(), organism_dir()
    stamp = target / STAMP
    if stamp.is_file() and stamp.read_text().strip() == pin_record["archive_sha256"]:
        log(f"organism {pin_record['model_sha256']}: up to date in {target}")
        return target
    archive = project_root() / ARCHIVE
    if not archive.is_file() or file_sha256(archive) != pin_record["archive_sha256"]:
        raise UsageError(f"{ARCHIVE} is missing or does not match the sha256 in {PIN}")
    target.parent.mkdir(parents=True, exist_ok=True)
    for leftover in target.parent.glob("organism.tmp-*"):  # from an interrupted unpack
        shutil.rmtree(leftover, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix="organism.tmp-", dir=target.parent))
    scratch.chmod(0o755)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(scratch, filter="data")
    for name, expected in pin_record["files"].items():
        if file_sha256(scratch / name) != expected:
            raise UsageError(f"{name} in {ARCHIVE} does not match its sha256 in {PIN}")
    (scratch / STAMP).write_text(pin_record["archive_sha256"] + "\n")
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix="organism.tmp-old-", dir=target.parent))
        target.rename(old / "organism")
        shutil.rmtree(old)
    scratch.rename(target)
    log(f"organism {pin_record['model_sha256']}: unpacked into {target} (checksums verified)")
    return target


def retrain(out_dir: str | Path, device: str = "cpu", log=print) -> bool:
    """Train the organism from its seed into `out_dir` and say whether it equals the pinned one."""
    from spectie.records.fingerprint import model_digest

    folder = train(out_dir, device=device, log=log)
    digest, pinned = model_digest(str(folder)), pinned_digest()
    same = digest == pinned
    log(f"retrained organism {digest} in {folder}: "
        + ("the same weights as the pinned organism" if same else
           f"NOT the pinned organism ({pinned}); training rounds differently on this machine, "
           "the book uses the pinned one"))
    return same


if __name__ == "__main__":
    import argparse
    import sys
    parser = argparse.ArgumentParser(description="the organism (a tiny Qwen3.5 model): unpack the pinned "
                                                 "weights, retrain from the seed, or pin a trained folder")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("unpack", help="unpack and verify the pinned organism into artifacts/organism")
    retrain_parser = commands.add_parser("retrain", help="train from the seed; compare with the pinned weights")
    retrain_parser.add_argument("--out", default=str(project_root() / "artifacts" / "organism-retrained"))
    retrain_parser.add_argument("--device", default="cpu")
    commands.add_parser("pin", help="pack a trained folder as the pinned organism").add_argument("folder")
    args = parser.parse_args()
    try:
        if args.command == "unpack":
            unpack()
        elif args.command == "retrain":
            retrain(args.out, args.device)
        else:
            print(json.dumps({k: v for k, v in pin(args.folder).items() if k != "recipe"}, indent=2))
    except (UsageError, OSError) as error:  # a folder that is not there too: one line, exit 2
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
