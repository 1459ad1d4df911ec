"""Reduction-order sensitivity: the same logits computed in different shapes, and the noise band.

A *shape* is how a server may compute the logits of a sequence it is decoding. Each one sums in its
own order, so each one rounds differently in low precision:

    full         one forward over the prompt and the continuation (GDN's chunked rule everywhere)
    decode       the prompt in one forward, then one token per step on the cache (GDN's recurrent rule)
    verify-K     the prompt, then steps of K+1 tokens on the cache: a speculative verify of width K+1
                 (the chunked rule, started from the cached state)
    verify-K@o   the same, with a first step of o tokens (0 < o <= K): the windows fall elsewhere
                 relative to the GDN chunks (64 tokens)
    prefill-C    everything in steps of C tokens on the cache: chunked prefill with chunk size C
    batch-B      one forward of B sequences of the same length (this one and B-1 other prompts)

Every shape is teacher-forced on one fixed token sequence (a prompt and the continuation the serving
precision generated), so every shape predicts the same positions from the same context, and each
costs one forward per step of the shape (a single forward for `full` and `batch-B`).

The *noise band* of a shape is the 99th percentile, over positions, of how much the margin between
the reference's top two tokens moves in that shape. Against the fp32 reference it holds the precision
and the order of the sums together; spectie.lab.bands.band_points splits it into the precision (`full` against the
reference) and the order of the sums alone (`order_band`: a shape against `full` in the same precision).
Flips (a different top-1 than the reference) are counted too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spectie.lab import qwen_shapes
from spectie.lab.sweeps import BAND_QUANTILE, DEFAULT_LOGIT_STD, LABEL, spread_of, weights_kind
from spectie.records.errors import UsageError
from spectie.records.record_types import Record

GDN_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule and fla's chunk kernels
SHAPE_PATTERN = re.compile(r"^(full|decode|verify-(\d+)(?:@(\d+))?|prefill-(\d+)|batch-(\d+))$")
@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # full | decode | verify | prefill | batch
    size: int = 0  # K for verify, C for prefill, B for batch
    offset: int = 0  # verify only: length of the first step after the prompt

    def steps(self, prompt: int, total: int) -> list[int]:
        """Lengths of the forwards this shape makes over a sequence of `total` tokens whose first
        `prompt` tokens are the prompt (its last row predicts the first generated token)."""
        if self.kind in ("full", "batch"):
            return [total]
        if self.kind == "prefill":
            return [min(self.size, total - start) for start in range(0, total, self.size)]
        head = [prompt]
        rest = total - prompt
        width = 1 if self.kind == "decode" else self.size + 1
        if self.kind == "verify" and self.offset:
            head.append(min(self.offset, rest))
            rest -= head[-1]
        return head + [min(width, rest - start) for start in range(0, rest, width)]


def parse_shape(text: str) -> Shape:
    """A shape from its name; a clear error for anything else (e.g. prefill-0, verify-3@5)."""
    match = SHAPE_PATTERN.match(str(text))
    if not match:
        raise UsageError(f"unknown shape {text!r}; valid: full, decode, verify-K, verify-K@offset, prefill-C, "
                         "batch-B (K, C, B >= 1)")
    _, k, offset, chunk, batch = match.groups()
    if k is not None:
        k, offset = int(k), int(offset or 0)
        if k < 1:
            raise UsageError(f"shape {text!r}: K (draft tokens) must be >= 1")
        if offset > k:
            raise UsageError(f"shape {text!r}: the offset must be between 0 and K ({k})")
        return Shape(text, "verify", k, offset)
    if chunk is not None:
        if int(chunk) < 1:
            raise UsageError(f"shape {text!r}: the chunk size must be >= 1 token")
        return Shape(text, "prefill", int(chunk))
    if batch is not None:
        if int(batch) < 1:
            raise UsageError(f"shape {text!r}: the batch size must be >= 1")
        return Shape(text, "batch", int(batch))
    return Shape(text, text)


def shape_logits(model, ids: list[int], positions: list[int], shape: Shape, others: list[list[int]] = ()):
    """Logits (float64, CPU) predicting the tokens at `positions`, computed in `shape`.

    The output head runs only on the rows needed. `others`: the extra sequences of a batch shape
    (each as long as `ids`).
    """
    import torch

    device = next(model.parameters()).device
    wanted = {p - 1: i for i, p in enumerate(positions)}  # row that predicts position p
    result = [None] * len(positions)
    with torch.no_grad():
        if shape.kind == "batch":
            batch = [ids] + [list(o) for o in others[:shape.size - 1]]
            if len(batch) < shape.size or any(len(seq) != len(ids) for seq in batch):
                raise UsageError(f"shape {shape.name}: needs {shape.size - 1} other sequences of {len(ids)} tokens")
            hidden = model.model(input_ids=torch.tensor(batch, device=device)).last_hidden_state[0]
            rows = hidden[torch.tensor(sorted(wanted), device=device)]
            return model.lm_head(rows).double().cpu()
        cache, start = None, 0
        for length in shape.steps(min(wanted) + 1, len(ids)):
            out = model.model(input_ids=torch.tensor([ids[start:start + length]], device=device),
                              past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            inside = [row for row in range(start, start + length) if row in wanted]
            if inside:
                logits = model.lm_head(out.last_hidden_state[0, [row - start for row in inside]]).double().cpu()
                for row, values in zip(inside, logits):
                    result[wanted[row]] = values
            start += length
    return torch.stack(result)


def compare(logits, reference) -> dict:
    """How `logits` differ from `reference` (both [positions, vocab]): deviations, flips, margin shifts."""
    import torch

    deviation = (logits - reference).abs().amax(dim=1)  # worst logit per position
    top2 = reference.topk(2, dim=1)
    first, second = top2.indices[:, 0], top2.indices[:, 1]
    rows = torch.arange(len(reference))
    margin = (top2.values[:, 0] - top2.values[:, 1])
    moved = (logits[rows, first] - logits[rows, second]) - margin  # change of the reference's top-2 margin
    flipped = logits.argmax(dim=1) != first
    quantiles = torch.quantile(deviation, torch.tensor([0.5, 0.9, 0.99], dtype=deviation.dtype))
    return {
        "positions": len(reference),
        "max_deviation": float(deviation.max()),
        "median_deviation": float(quantiles[0]),
        "p90_deviation": float(quantiles[1]),
        "p99_deviation": float(quantiles[2]),
        "top1_disagreements": int(flipped.sum()),
        "noise_band": float(torch.quantile(moved.abs(), BAND_QUANTILE)),
        "largest_flipped_margin": float(margin[flipped].max()) if bool(flipped.any()) else None,
        "pairs": [(float(m), bool(f)) for m, f in zip(margin, flipped)],
        "margin_shifts": [float(x) for x in moved],
    }


def measure(model, dtype: str, ids: list[int], positions: list[int], shapes: list[Shape], reference,
            others: list[list[int]] = (), label: dict | None = None, progress: bool = False) -> list[dict]:
    """One row per shape: `compare` against the reference, plus top-1 disagreements with plain decode
    in the same precision (what a speculative server is compared with)."""
    from tqdm import tqdm

    computed = {}
    for shape in tqdm(shapes, desc=f"{(label or {}).get('kernels', '')} {dtype} shapes", disable=not progress, leave=False):
        computed[shape.name] = shape_logits(model, ids, positions, shape, others)
    decode = computed.get("decode")
    rows = []
    for shape in shapes:
        logits = computed[shape.name]
        row = {**(label or {}), "dtype": dtype, "shape": shape.name, "kind": shape.kind,
               **compare(logits, reference)}
        if decode is not None:
            row["top1_vs_decode"] = int((logits.argmax(dim=1) != decode.argmax(dim=1)).sum())
        rows.append(row)
    return rows


FP32_HEAD = "+fp32-head"  # dtype suffix: the body in that dtype, the output head in fp32 on its hidden states


def body_dtype(dtype: str) -> str:
    """The precision of the model's body for a sweep dtype (`bfloat16+fp32-head` -> `bfloat16`)."""
    return dtype.removesuffix(FP32_HEAD)


def with_fp32_head(model):
    """The output head computed in fp32 on the body's hidden states, as a server that keeps its logits in
    fp32 does: an fp32 copy of the head's weights (untied from the embeddings), its input cast up."""
    import torch

    head = model.lm_head
    fp32 = torch.nn.Linear(head.in_features, head.out_features, bias=False, device=head.weight.device,
                           dtype=torch.float32)
    with torch.no_grad():
        fp32.weight.copy_(head.weight.float())
    fp32.register_forward_pre_hook(lambda module, args: (args[0].float(),))
    model.lm_head = fp32
    return model


KERNELS = ("torch", "fla")
CPU_SHAPES = ("full", "decode", "verify-1", "verify-3", "verify-7", "verify-7@3", "prefill-64", "prefill-512", "batch-4")
DEFAULT_SHAPES = ("full", "decode", "verify-1", "verify-2", "verify-3", "verify-4", "verify-5", "verify-6", "verify-7",
                  "verify-8", "verify-7@2", "verify-7@5", "prefill-64", "prefill-128", "prefill-512", "prefill-2048",
                  "batch-1", "batch-4")


def kernel_context(kernels: str):
    """`torch`: transformers' reference GDN code; `fla`: flash-linear-attention's kernels (GPU only)."""
    import contextlib
    import importlib.util

    from spectie.lab.model import reference_gdn_kernels

    if kernels not in KERNELS:
        raise UsageError(f"unknown kernel backend {kernels!r}; valid: {', '.join(KERNELS)}")
    if kernels == "torch":
        return reference_gdn_kernels()
    if importlib.util.find_spec("fla") is None:
        raise UsageError("kernels 'fla' need flash-linear-attention (pip install flash-linear-attention==0.6.0; "
                         "GPU only: on a CPU-only machine it breaks transformers' GDN dispatch)")
    return contextlib.nullcontext()


def check_plan(device: str, dtypes: list[str], shapes: list[str], kernels: list[str], tf32: list[bool],
               model: str | None = None, reference_dtype: str = "float32") -> list[Shape]:
    """Every parameter of a sweep, checked before any model is loaded (for a random-weight Qwen3.5
    shape, also whether each precision fits this host's memory)."""
    from spectie.lab.model import check_device, torch_dtype

    check_device(device)
    for dtype in [*dtypes, reference_dtype]:
        torch_dtype(body_dtype(dtype))
    for name in kernels:
        if name not in KERNELS:
            raise UsageError(f"unknown kernel backend {name!r}; valid: {', '.join(KERNELS)}")
        if name == "fla" and device == "cpu":
            raise UsageError("kernels 'fla' run only on a GPU (device=cuda)")
        if name == "fla":
            kernel_context("fla")  # raises now, before any model loads, if flash-linear-attention is missing
    if any(tf32) and device == "cpu":
        raise UsageError("TF32 exists only on NVIDIA GPUs: use tf32: [false] on CPU")
    if not shapes:
        raise UsageError("give at least one shape")
    plan = [parse_shape(s) for s in shapes]
    if model is not None and qwen_shapes.is_shape(model):
        from spectie.lab.host import check_fits

        check_fits(model, [body_dtype(d) for d in [*dtypes, reference_dtype]], device)
    return plan


@dataclass(frozen=True)
class Source:
    """Where a sweep's models come from: a checkpoint (the organism, a folder, a hub id) or a
    random-weight Qwen3.5 shape, built from `seed` with its logits scaled by `scale`."""
    model: str
    tokenizer: str
    checkpoint: str | None = None
    seed: int = 0
    scale: float = 1.0

    @property
    def weights(self) -> str:
        return "trained" if self.checkpoint else "random"

    def load(self, dtype: str, device: str):
        """The model in `dtype` (a `+fp32-head` dtype: its body in that precision, the head in fp32)."""
        import torch

        from spectie.lab.model import load_model

        body = body_dtype(dtype)
        if self.checkpoint:
            model = load_model(self.checkpoint, body, device)
        else:
            model = qwen_shapes.build(self.model, body, device, self.seed, self.scale)
            torch.backends.cuda.matmul.allow_tf32 = False  # as load_model: true precision unless asked
            torch.backends.cudnn.allow_tf32 = False
        return with_fp32_head(model) if body != dtype else model


def open_source(model: str) -> Source:
    """`organism`, a model folder, a hub id, or a Qwen3.5 shape name (random weights)."""
    from spectie.lab.model import resolve_model
    from spectie.lab.tokenizer import tokenizer_dir

    if qwen_shapes.is_shape(model):
        if not (tokenizer_dir() / "tokenizer.json").is_file():
            raise UsageError(f"the Qwen3.5 tokenizer is not built ({tokenizer_dir()}): run `make setup`")
        return Source(model, str(tokenizer_dir()))
    path = resolve_model(model)
    return Source(model, path, checkpoint=path)


def sweep(model: str, device: str, dtypes: list[str], shapes: list[str], kernels: list[str] = ("torch",),
          tf32: list[bool] = (False,), prompt_tokens: int = 1845, prompt_seed: int = 0, new_tokens: int = 96,
          reference_dtype: str = "float32", progress: bool = True, weights_seed: int = 0,
          logit_std: float = DEFAULT_LOGIT_STD) -> dict:
    """Every (kernels, TF32, dtype, shape) against one reference: the prompt and the continuation that
    bf16 greedy decoding writes (torch kernels), teacher-forced; the reference is a `full` forward in
    `reference_dtype` through the torch kernels with TF32 off. `weights_seed` and `logit_std` apply
    to random-weight Qwen3.5 shapes only."""
    import dataclasses

    from spectie.lab.model import greedy_generate
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    plan = check_plan(device, list(dtypes), list(shapes), list(kernels), list(tf32), model, reference_dtype)
    source = open_source(model)
    tokenizer = model_tokenizer(str(source.tokenizer))
    prompt = build_prompt(PromptSpec(tokens=prompt_tokens, seed=prompt_seed), tokenizer)
    eos = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    batch = max([s.size for s in plan if s.kind == "batch"] + [1])
    with kernel_context("torch"):
        if source.weights == "random":
            scale = qwen_shapes.logit_scale(model, device, list(prompt.token_ids), logit_std, weights_seed)
            source = dataclasses.replace(source, seed=weights_seed, scale=scale)
        generator = source.load("bfloat16", device)
        generation = greedy_generate(generator, list(prompt.token_ids), new_tokens, eos)
        del generator
        ids = generation.ids
        others = [list(build_prompt(PromptSpec(tokens=len(ids), seed=prompt_seed + 1 + i), tokenizer).token_ids)
                  for i in range(batch - 1)]
        positions = [generation.position(i) for i in range(len(generation.output_ids))]
        reference_model = source.load(reference_dtype, device)
        parameter_count = sum(p.numel() for p in reference_model.parameters())
        reference = shape_logits(reference_model, ids, positions, parse_shape("full"))
        del reference_model
    rows = measure_every_setting(source, device, dtypes, kernels, tf32, ids, positions, plan, reference, others,
                                 progress)
    weights = ({"kind": "trained checkpoint"} if source.weights == "trained" else
               {"kind": LABEL, "seed": source.seed, "logit_std": logit_std, "logit_scale": source.scale})
    return {"prompt": prompt.describe(), "output_tokens": len(generation.output_ids), "model_parameters": parameter_count,
            "weights": weights, "finish_reason": generation.finish_reason, "positions": len(positions),
            "reference_logits": logit_magnitudes(reference),
            "reference": {"dtype": reference_dtype, "shape": "full", "kernels": "torch", "tf32": False},
            "rows": rows}


def measure_every_setting(source: Source, device: str, dtypes: list[str], kernels: list[str], tf32: list[bool],
                          ids: list[int], positions: list[int], plan: list[Shape], reference, others: list[list[int]],
                          progress: bool) -> list[dict]:
    """`measure` for every (kernels, TF32, dtype): the model loaded in each dtype in turn; TF32 off again after."""
    import torch

    rows = []
    for backend in kernels:
        for tf32_on in tf32:
            with kernel_context(backend):
                for dtype in dtypes:
                    model_in_dtype = source.load(dtype, device)
                    torch.backends.cuda.matmul.allow_tf32 = bool(tf32_on)  # loading switches it off
                    torch.backends.cudnn.allow_tf32 = bool(tf32_on)
                    rows += measure(model_in_dtype, dtype, ids, positions, plan, reference, others,
                                    {"kernels": backend, "tf32": bool(tf32_on)}, progress)
                    del model_in_dtype
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return rows


def logit_magnitudes(reference) -> dict:
    """How large the reference's logits are at the scored positions (median over positions): its top-1
    logit, the gap to its runner-up, the spread over the vocabulary. A random-weight shape's band scales with
    them; the incident's own top-2 logits were about 16 (reported), which calibrates the spread."""
    top2 = reference.topk(2, dim=1).values
    return {"top1_median": float(top2[:, 0].median()), "top2_gap_median": float((top2[:, 0] - top2[:, 1]).median()),
            "std_median": float(reference.std(dim=1).median())}


def measured_sweep_record(dump: dict, environment: str, chapter: str = "reduction_order") -> dict:
    """A measured record, as the dict to write, from a sweep's dump (parameters, results, times, fingerprint of the
    host that ran it)."""
    from spectie.records.chapters import current_hash
    from spectie.records.store import measured_record

    parameters, results = dump["parameters"], dump["results"]  # the dump's own dicts: a record is made of them
    model, weights = parameters["model"], results.get("weights")
    label = f"{model} ({LABEL})" if weights_kind(weights) == LABEL else model
    name = f"{chapter}-{environment}-{model}-{dump['fingerprint']['host_id']}" + (
        f"-spread-{weights['logit_std']:g}" if spread_of(weights) else "")
    return measured_record(
        record_id=name.replace("_", "-").replace(".", "-"), kind="reduction-sweep", chapter=chapter,
        title=f"Reduction-order sweep of {label} ({parameters['device']})", environment=environment,
        parameters=parameters, results=results, started_at=dump["started_at"],
        finished_at=dump["finished_at"], fingerprint=dump["fingerprint"],
        content_hash=dump.get("content_hash") or current_hash(chapter))


# The files whose code computes a sweep (with the weights, parameters and library versions: its measurement key).
SOURCES = ("spectie/lab/reduction_order.py", "spectie/lab/model.py", "spectie/lab/qwen_shapes.py", "spectie/lab/prompts.py",
           "spectie/lab/sweeps.py")


def run(model: str, device: str, environment: str, dtypes: list[str], shapes: list[str], kernels: list[str],
        tf32: list[bool], prompt_tokens: int, prompt_seed: int, new_tokens: int, weights_seed: int,
        logit_std: float) -> Record:
    """The chapter's sweep on this host, as a record: an earlier record of this host (or of a host of identical
    hardware) holding the same measurement (weights, parameters, library versions, code and device), or a new
    sweep, written before it is returned. Every parameter is checked before any model loads."""
    from spectie.records.fingerprint import environment_fingerprint, measurement_key, now
    from spectie.records.paths import project_root
    from spectie.records.store import measured_path, read_record, recorded_measurement, standing_hosts, write_record

    check_plan(device, dtypes, shapes, kernels, tf32, model)
    parameters = {"model": model, "device": device, "dtypes": dtypes, "shapes": shapes, "kernels": kernels,
                  "tf32": tf32, "prompt_tokens": prompt_tokens, "prompt_seed": prompt_seed, "new_tokens": new_tokens,
                  "reference_dtype": "float32", "weights_seed": weights_seed, "logit_std": logit_std}
    key = measurement_key("reduction-sweep", model, parameters, SOURCES)
    measured = project_root() / "results" / "measured"
    hosts = [measured / f"{environment}-{host}" / "reduction_order" for host in standing_hosts(environment)]
    for path in (path for folder in hosts for path in sorted(folder.glob("*.json"))):  # the key holds the device
        if (earlier := recorded_measurement(path, key)) is not None:
            return earlier
    started_at = now()
    result = sweep(model, device, dtypes, shapes, kernels, tf32, prompt_tokens, prompt_seed, new_tokens, "float32",
                   progress=True, weights_seed=weights_seed, logit_std=logit_std)
    dump = {"parameters": dict(parameters, measurement_key=key), "results": result, "started_at": started_at,
            "finished_at": now(), "fingerprint": environment_fingerprint(",".join(dtypes), model)}
    record = measured_sweep_record(dump, environment)
    return read_record(write_record(record, measured_path(record)))


# The columns a reader sees, in words (the record's field names do not wrap in a narrow column).


