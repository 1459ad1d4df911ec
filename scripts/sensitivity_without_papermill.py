"""Run the reduction-order sweep (spectie.sensitivity) on a host without papermill and dump the result.

The team's H200 host has torch, transformers and triton but no papermill, jsonschema or network. This
script runs spectie.sensitivity.sweep on the organism with the fast GDN kernels (flash-linear-attention,
carried as wheels) and transformers' torch reference code, TF32 off and on, and dumps the raw result
to $OUT/sweep.json; `python scripts/sensitivity_without_papermill.py --record sweep.json ENV` then
validates it and writes the measured record here (results/measured/<env>-<host>/reduction_order/).

On the GPU host (gpu-carry/ holds the organism as a tgz and the fla, fla-core and einops wheels):
    tar xzf gpu-carry/artifacts.tgz && pip install --no-deps gpu-carry/*.whl
    PYTHONPATH=. python3 scripts/sensitivity_without_papermill.py --sweep cuda
"""
import json
import os
import sys
import time

from spectie import sensitivity


def run(device: str) -> None:
    from spectie.fingerprint import environment_fingerprint, now
    from spectie.organism import organism_dir

    started_at, t0 = now(), time.time()
    kernels = ["torch", "fla"] if device.startswith("cuda") else ["torch"]
    tf32 = [False, True] if device.startswith("cuda") else [False]
    parameters = {"model": "organism", "device": device, "dtypes": ["bfloat16", "float16", "float32"],
                  "shapes": list(sensitivity.DEFAULT_SHAPES), "kernels": kernels, "tf32": tf32,
                  "prompt_tokens": 1845, "prompt_seed": 0, "new_tokens": 96, "reference_dtype": "float32"}
    result = sensitivity.sweep(str(organism_dir()), device, parameters["dtypes"], parameters["shapes"], kernels,
                               tf32, 1845, 0, 96, "float32", progress=False)
    dump = {"parameters": parameters, "results": result, "started_at": started_at, "finished_at": now(),
            "seconds": round(time.time() - t0, 1), "fingerprint": environment_fingerprint("bfloat16"),
            "content_hash": sensitivity._package_hash()}
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as handle:
        json.dump(dump, handle)
    print(f"{len(result['rows'])} rows, {result['positions']} positions, {dump['seconds']} s")
    print("kernels tf32 dtype shape max_dev band top1 top1_vs_decode")
    for row in result["rows"]:
        print(row["kernels"], row["tf32"], row["dtype"], row["shape"], f"{row['max_deviation']:.4f}",
              f"{row['noise_band']:.4f}", row["top1_disagreements"], row.get("top1_vs_decode"))


def record(path: str, environment: str) -> None:
    from spectie.records import measured_path, write_record

    dump = json.load(open(path))
    record = sensitivity.measured_sweep_record(dump, environment)
    print(write_record(record, measured_path(record)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sweep"]:
        run(sys.argv[2])
    elif sys.argv[1:2] == ["--record"]:
        record(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
