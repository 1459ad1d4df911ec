"""Run the reduction-order sweep (spectie.reduction_order) on a host without papermill and dump the result.

The team's H200 host has torch, transformers and triton but no papermill, jsonschema or network. This
script runs spectie.reduction_order.sweep with the fast GDN kernels (flash-linear-attention, carried as
wheels) and transformers' torch reference code, and dumps each model's raw result to
$OUT/sweep-<model>.json; `python scripts/reduction_order_without_papermill.py --record sweep-<model>.json ENV`
then validates it and writes the measured record here (results/measured/<env>-<host>/reduction_order/).

Models: `organism` (TF32 off and on) and the random-weight Qwen3.5 shapes (spectie.qwen_shapes; TF32
off), each over the 18 default shapes in bf16, fp16 and fp32 unless SWEEP_SHAPES / SWEEP_DTYPES narrow them.

On the GPU host (gpu-carry/ holds the organism and tokenizer as a tgz and the fla, fla-core and einops wheels):
    tar xzf gpu-carry/artifacts.tgz && python3 -m pip install --no-deps gpu-carry/*.whl
    PYTHONPATH=. python3 scripts/reduction_order_without_papermill.py --sweep cuda organism qwen3.5-0.8b-shape
"""
import json
import os
import sys
import time

from spectie import reduction_order


def run(device: str, model: str) -> None:
    from spectie.chapters import current_hash
    from spectie.fingerprint import environment_fingerprint, now

    started_at, t0 = now(), time.time()
    gpu = device.startswith("cuda")
    kernels = ["torch", "fla"] if gpu else ["torch"]
    tf32 = [False, True] if gpu and model == "organism" else [False]
    # SWEEP_DTYPES / SWEEP_SHAPES (comma-separated; SWEEP_SHAPES=cpu: the chapter's 9 default shapes)
    # narrow a sweep to fit a device's time.
    dtypes = os.environ.get("SWEEP_DTYPES", "bfloat16,float16,float32").split(",")
    shapes = os.environ.get("SWEEP_SHAPES", ",".join(reduction_order.DEFAULT_SHAPES))
    shapes = list(reduction_order.CPU_SHAPES) if shapes == "cpu" else shapes.split(",")
    parameters = {"model": model, "device": device, "dtypes": dtypes, "shapes": shapes, "kernels": kernels, "tf32": tf32,
                  "prompt_tokens": 1845, "prompt_seed": 0, "new_tokens": 96, "reference_dtype": "float32",
                  "weights_seed": 0, "logit_std": 3.0}
    result = reduction_order.sweep(model, device, parameters["dtypes"], parameters["shapes"], kernels, tf32, 1845, 0, 96,
                               "float32", progress=True, weights_seed=0, logit_std=3.0)
    dump = {"parameters": parameters, "results": result, "started_at": started_at, "finished_at": now(),
            "seconds": round(time.time() - t0, 1), "fingerprint": environment_fingerprint(",".join(dtypes), model),
            "content_hash": current_hash("reduction_order")}
    with open(os.path.join(os.environ.get("OUT", "."), f"sweep-{model}.json"), "w") as handle:
        json.dump(dump, handle)
    print(f"{model}: {len(result['rows'])} rows, {result['positions']} positions, {dump['seconds']} s, "
          f"weights {result['weights']}")
    print("kernels tf32 dtype shape max_dev band top1 top1_vs_decode")
    for row in result["rows"]:
        print(row["kernels"], row["tf32"], row["dtype"], row["shape"], f"{row['max_deviation']:.4f}",
              f"{row['noise_band']:.4f}", row["top1_disagreements"], row.get("top1_vs_decode"), flush=True)


def record(path: str, environment: str) -> None:
    from spectie.records import measured_path, write_record

    dump = json.load(open(path))
    record = reduction_order.measured_sweep_record(dump, environment)
    print(write_record(record, measured_path(record)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sweep"] and len(sys.argv) > 2:
        for name in sys.argv[3:] or ["organism"]:
            run(sys.argv[2], name)
    elif sys.argv[1:2] == ["--record"]:
        record(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
