"""The lab: models and numerics without vLLM; it imports the record store only.

- `model`: every model loaded (the organism, a folder, a hub id), dtypes, devices, greedy and teacher-forced
  forwards; `organism`: the pinned tiny Qwen3.5; `qwen_shapes`: Qwen3.5 shapes with random weights;
- `prompts` and `tokenizer`: the incident-shaped prompts and the Qwen3.5 tokenizer;
- measurements with torch: `margins` (fp32 against bf16), `reduction_order` (logits per computation shape),
  `bands` (the bf16 noise bands recorded), `bench` (the scans' cost), and what a sweep record says of its weights and
  band, for its writers and its readers (`sweeps`);
- `host` and `memory`: whether a model fits this host, before any work.
"""
