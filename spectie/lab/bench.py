"""Benchmark of the reduction-order sweep's computations (`make bench`): prints figures, writes a record.

For one model and sequence (a prompt and `new_tokens` teacher-forced tokens), per precision:

    plain forward   model(input_ids): the whole sequence in one forward, logits for every row
    scan            the `full` shape: one forward, the output head only on the scored rows
    verify-K        K+1 tokens per forward on the cache after the prompt (the speculative verify emulation)
    decode          one token per forward after the prompt

Each figure: the forwards made, the seconds (best of `repeats` after a warm-up), the sequence tokens per
second, and the time as a multiple of the plain forward. On a GPU also the achieved matmul rate (FLOPs of
the weights' matrix products, 2 x weights x tokens; attention scores and GDN state updates are not
counted) against the bf16 matrix rate measured on the same GPU with a large square matmul.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spectie.records.errors import UsageError

SHAPES = ("full", "verify-1", "verify-3", "verify-7", "decode")


def best_time(fn, device: str, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one warm-up call."""
    import torch

    def timed():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()
    return min(timed() for _ in range(repeats))


GPU_MATMUL_SIZE, CPU_MATMUL_SIZE = 8192, 1024  # the square matmul whose rate is measured


def matmul_rate(device: str, dtype: str = "bfloat16", size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of one square matmul of `size` (8192 on a GPU, 1024 on CPU) in `dtype`."""
    import torch

    from spectie.lab.model import torch_dtype

    size = size or (GPU_MATMUL_SIZE if device.startswith("cuda") else CPU_MATMUL_SIZE)
    a = torch.randn(size, size, device=device, dtype=torch_dtype(dtype))
    b = torch.randn(size, size, device=device, dtype=torch_dtype(dtype))
    return 2 * size**3 / best_time(lambda: a @ b, device, repeats)


def matmul_flops(model, tokens: int, scored_rows: int) -> int:
    """2 x (weights of the decoder's linear layers) x tokens + the output head on the scored rows."""
    import torch

    body = sum(m.weight.numel() for name, m in model.model.named_modules() if isinstance(m, torch.nn.Linear))
    return 2 * body * tokens + 2 * model.lm_head.weight.numel() * scored_rows


def run(model: str = "organism", device: str = "cpu", dtypes=("float32", "bfloat16"), shapes=SHAPES,
        prompt_tokens: int = 1845, new_tokens: int = 96, repeats: int | None = None, log=print) -> dict:
    """Time every shape in every precision; returns the parameters, the matmul rate and one row per figure.
    `repeats`: timed calls per figure after the warm-up (default 3 on a GPU, 1 on CPU, where a bf16
    plain forward over Qwen3.5's vocabulary takes most of a minute)."""
    import torch

    from spectie.lab import reduction_order
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    plan = reduction_order.check_plan(device, list(dtypes), list(shapes), ["torch"], [False], model)
    if prompt_tokens < 1 or new_tokens < 1:
        raise UsageError("prompt_tokens and new_tokens must be >= 1")
    repeats = repeats or (3 if device.startswith("cuda") else 1)
    source = reduction_order.open_source(model)
    tokenizer = model_tokenizer(str(source.tokenizer))
    ids = list(build_prompt(PromptSpec(tokens=prompt_tokens + new_tokens, seed=0), tokenizer).token_ids)
    positions = list(range(len(ids) - new_tokens, len(ids)))
    rate = matmul_rate(device) if device.startswith("cuda") else None
    rows = []
    with reduction_order.kernel_context("torch"):
        for dtype in dtypes:
            loaded = source.load(dtype, device)
            inputs = torch.tensor([ids], device=device)
            with torch.no_grad():
                plain = best_time(lambda: loaded(input_ids=inputs), device, repeats)
            rows.append(_row(loaded, dtype, "plain forward", 1, plain, plain, len(ids), len(ids), rate))
            log(_line(rows[-1]))
            for shape in plan:
                seconds = best_time(lambda: reduction_order.shape_logits(loaded, ids, positions, shape), device, repeats)
                forwards = len(shape.steps(positions[0], len(ids)))
                rows.append(_row(loaded, dtype, shape.name, forwards, seconds, plain, len(ids), new_tokens, rate))
                log(_line(rows[-1]))
            loaded = None  # the weights go before the next precision loads (the timed closures hold this name)
    return {"parameters": {"model": model, "device": device, "dtypes": list(dtypes), "shapes": list(shapes),
                           "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
                           "kernels": "torch", "tf32": False},
            "bf16_matmul_flops_per_s": rate, "rows": rows}


def _row(model, dtype, shape, forwards, seconds, plain, tokens, scored, rate) -> dict:
    row = {"dtype": dtype, "shape": shape, "forwards": forwards, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "vs_plain_forward": seconds / plain}
    if rate:
        achieved = matmul_flops(model, tokens, scored) / seconds
        row.update(flops_per_s=achieved, share_of_bf16_matmul=achieved / rate)
    return row


def _line(row: dict) -> str:
    text = (f"{row['dtype']:>9} {row['shape']:<14} {row['forwards']:>4} forwards {row['seconds']:8.3f} s "
            f"{row['tokens_per_s']:10.0f} tok/s {row['vs_plain_forward']:6.2f}x plain forward")
    if "flops_per_s" in row:
        text += f" {row['flops_per_s'] / 1e12:7.1f} TFLOP/s ({row['share_of_bf16_matmul']:.0%} of bf16 matmul)"
    return text


def bench_record(dump: dict, environment: str) -> dict:
    """A measured record (kind `benchmark`) of a bench dump, in the reduction_order chapter: the dict to write."""
    from spectie.records.store import measured_record

    results = dump["results"]  # the dump's own dict (its `parameters` become the record's): a record is made of it
    parameters = results["parameters"]
    model = parameters["model"]
    return measured_record(
        record_id=f"bench-{environment}-{model}-{dump['fingerprint']['host_id']}".replace("_", "-").replace(".", "-"),
        kind="benchmark", chapter="reduction_order",
        title=f"Cost of the reduction-order scans: {model} ({parameters['device']})",
        environment=environment, parameters=parameters, results=results,
        started_at=dump["started_at"], finished_at=dump["finished_at"], fingerprint=dump["fingerprint"],
        content_hash=dump["content_hash"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectie.lab.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="organism", help="organism, a model folder, or a Qwen3.5 shape name")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=1845)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per figure (default 3 on GPU, 1 on CPU)")
    parser.add_argument("--env", help="environment id: write a measured record under results/")
    parser.add_argument("--dump", help="write the raw figures to this JSON file (hosts without jsonschema)")
    parser.add_argument("--record-from", metavar="DUMP", help="make the record of a dump written elsewhere (with --env)")
    args = parser.parse_args(argv)
    try:
        if args.env:
            from spectie.records.environments import get_environment

            get_environment(args.env)  # before any heavy work
        dump = read_dump(args.record_from) if args.record_from else measure(args)
        if args.env:
            from spectie.records.store import measured_path, write_record

            record = bench_record(dump, args.env)
            print(f"record: {write_record(record, measured_path(record))}")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def read_dump(path: str) -> dict:
    """A dump written by --dump elsewhere; a missing or unreadable file is a UsageError naming it."""
    try:
        with open(path, encoding="utf-8") as handle:
            dump = json.load(handle)
    except OSError as exc:
        raise UsageError(f"--record-from {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--record-from {path}: not JSON ({exc})") from None
    if not isinstance(dump, dict) or "results" not in dump:
        raise UsageError(f"--record-from {path}: not a dump written by --dump (no results)")
    return dump


def measure(args) -> dict:
    """The benchmark the command line asks for (after the same host checks as make run, with --env), as a dump:
    its results, when, where, and the chapter's content hash; written to --dump where given."""
    from spectie.lab import host
    from spectie.records.chapters import current_hash
    from spectie.records.environments import get_environment
    from spectie.records.fingerprint import environment_fingerprint, now

    if args.env:  # the same host checks as make run, before any model is built
        for line in host.check("reduction_order", get_environment(args.env), {"device": args.device, "model": args.model}):
            print(f"host check: {line}")
    started_at = now()
    print(f"benchmark: {args.model} on {args.device}, {args.prompt_tokens}+{args.new_tokens} tokens")
    results = run(args.model, args.device, args.dtypes.split(","), SHAPES, args.prompt_tokens, args.new_tokens,
                  args.repeats)
    if results["bf16_matmul_flops_per_s"]:
        print(f"bf16 matmul rate ({GPU_MATMUL_SIZE}^3): {results['bf16_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    dump = {"results": results, "started_at": started_at, "finished_at": now(),
            "fingerprint": environment_fingerprint(args.dtypes, args.model), "content_hash": current_hash("reduction_order")}
    if args.dump:
        with open(args.dump, "w") as handle:
            json.dump(dump, handle)
    return dump

if __name__ == "__main__":
    sys.exit(main())
