"""Run the margins chapter's measurement on a host without papermill (the H200) and dump its records.

The team's H200 host has torch and transformers but no papermill or jsonschema, and no network. This
script does what notebooks/margins.ipynb measures, with the same package functions and the chapter's
default parameters, and dumps the records to $OUT/records.json; they are validated and written here
with spectie.records.write_record. It produced the committed results/measured/h200-*/ records:

    tar czf gpu-carry/artifacts.tgz artifacts/organism artifacts/qwen3.5-tokenizer   # 12 MB
    (on the GPU host) tar xzf gpu-carry/artifacts.tgz && PYTHONPATH=. python3 scripts/margins_without_papermill.py h200 cuda

Usage: margins_without_papermill.py ENVIRONMENT DEVICE
"""
import importlib.util
import json
import os
import sys
import time

from spectie import margins
from spectie.fingerprint import now
from spectie.prompts import PromptSpec, build_prompt, prompt_set

environment, device = sys.argv[1], sys.argv[2]
out = os.environ["OUT"]
started_at = now()
t0 = time.time()
setup = margins.prepare("organism", device, ["<|endoftext|>", "DATA"], "bfloat16", ["float64", "float32", "bfloat16"])
print("setup", setup.describe(), round(time.time() - t0, 1), "s", flush=True)
print("fla importable:", importlib.util.find_spec("fla") is not None)
params = {"prompt": None, "max_new_tokens": 96, "watch_tokens": ["<|endoftext|>", "DATA"], "serving_dtype": "bfloat16",
          "compare_dtypes": setup.dtypes}
prompt = build_prompt(PromptSpec(tokens=1845, seed=0), setup.tokenizer)
params["prompt"] = prompt.describe()
t0 = time.time()
main = margins.measure_prompt(setup.models, "bfloat16", list(prompt.token_ids), 96, setup.eos_ids, setup.watch, setup.decode)
print("main", round(time.time() - t0, 2), "s", flush=True)
decisive = margins.decisive_comparison(main, setup.watch)
g = main.generation
records = [
    margins.chapter_record(setup, environment, "decisive", "logit-comparison", "Watched pair at the decisive position", params,
                           dict(decisive, finish_reason=g.finish_reason, output_tokens=len(g.output_ids),
                                tail_text=setup.tokenizer.decode(g.output_ids)[-80:]), started_at),
    margins.chapter_record(setup, environment, "scan", "margin-scan", "Margins at every generated position", params,
                           {"rows": main.rows, "output_ids": g.output_ids, "finish_reason": g.finish_reason}, started_at),
]
json.dump(records, open(f"{out}/records.json", "w"))
t0 = time.time()
specs = prompt_set(40, 256, first_seed=1000)
pairs, eos_flips, _ = margins.sweep(setup, specs, 48, progress=False)
print("sweep", round(time.time() - t0, 2), "s", len(pairs), "pairs", sum(f for _, f in pairs), "flips", len(eos_flips), "eos flips", flush=True)
edges = [0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 1000]
sweep_params = dict(params, sweep_prompts=40, sweep_prompt_tokens=256, sweep_new_tokens=48)
records.append(margins.chapter_record(
    setup, environment, "flips", "flip-curve", "bf16 top-1 flips against the fp64 margin", sweep_params,
    {"reference": "fp64", "other": "bf16", "bins": margins.flip_curve(pairs, edges),
     "pairs": [[m, f] for m, f in pairs], "eos_flips": eos_flips}, started_at))
json.dump(records, open(f"{out}/records.json", "w"))
print("decisive", json.dumps(decisive), g.finish_reason, len(g.output_ids))
