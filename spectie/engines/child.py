"""One vLLM engine in its own process: the reproduction chapter's child (run by spectie.engines.runner).

It imports only the standard library, vLLM and `spectie.tools.tiestop` (standard library only), so it runs in
any environment's interpreter (the project's `.venv` with the CPU build of vLLM, or an environment's
own venv with the official wheel).

    python -m spectie.engines.child probe             # vLLM version, platform, accepted engine arguments
    python -m spectie.engines.child run request.json  # one engine, `repeats` greedy generations of each
                                                     # of its `prompts` (one by one, or as one batch)

It reports on stdout, one JSON event per line after the marker `@@spectie `; every other line is
vLLM's own log. Events: started, engine_ready, repeat (one per finished generation and prompt, so a
crash later loses nothing), error (with the phase it happened in and the traceback's last lines), done.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback

MARKER = "@@spectie "
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def emit(event: str, **fields) -> None:
    print(MARKER + json.dumps({"event": event, **fields}), flush=True)


def token_hash(token_ids) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


V2_ONLY_FROM = (0, 34)  # vLLM 0.34.0 has no V1 model runner left: every engine runs the V2 one


def release_key(version: str) -> tuple[int, ...]:
    """(major, minor) of a vLLM version string ('0.34.0+cu130' -> (0, 34)); () when it names none."""
    import re

    match = re.match(r"^(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else ()


def model_runner(version: str, use_v2) -> str:
    """The model runner an engine used: its config's flag where it has one, else V2 from vLLM 0.34.0 on."""
    if use_v2 is not None:
        return "V2" if use_v2 else "V1"
    return "V2" if release_key(version) >= V2_ONLY_FROM else "V1"


def probe() -> dict:
    """What the installed vLLM offers: version, platform, engine argument names, speculative methods."""
    import dataclasses
    import platform
    import typing

    import torch
    import transformers
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    methods, methods_error = None, None
    try:
        from vllm.config.speculative import SpeculativeMethod

        def flatten(tp):
            args = typing.get_args(tp)
            return [a for arg in args for a in (flatten(arg) if typing.get_args(arg) else [arg])]

        methods = sorted({m for m in flatten(SpeculativeMethod) if isinstance(m, str)})
    except Exception as exc:  # the matrix check stops on it (checks.check_matrix): it says, not guesses
        methods_error = f"{type(exc).__name__}: {exc}"
    try:  # the commit a wheel was built from (None for some release builds)
        from vllm._version import commit_id
    except Exception:
        commit_id = None
    return {"vllm_version": vllm.__version__, "vllm_commit": commit_id, "platform": str(current_platform.device_type),
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "engine_args": sorted(f.name for f in dataclasses.fields(EngineArgs)),
            "speculative_methods": methods, "speculative_methods_error": methods_error}


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far (empty without speculation or without stats); metrics that
    cannot be read are recorded as unknown ({"unreadable": why}), never as "no drafts"."""
    counters = {}
    try:
        for metric in llm.get_metrics():
            if metric.name in SPEC_COUNTERS:
                counters[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
            elif metric.name == PER_POSITION:
                counters["accepted_per_position"] = [int(v) for v in metric.values]
    except Exception as exc:  # metrics are evidence, not needed to run the matrix: the run goes on, saying so
        return {"unreadable": f"{type(exc).__name__}: {exc}"[:300]}
    return counters


def difference(after: dict, before: dict) -> dict:
    """The counters of one batch (after - before); unknown if either reading was unreadable."""
    if "unreadable" in after or "unreadable" in before:
        return {"unreadable": after.get("unreadable") or before.get("unreadable")}
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            old = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def margins(result) -> dict:
    """From a `RequestOutput` with top-2 logprobs: each output token's logprob margin over the best other
    token (the stop token's is the tie-stop detector's figure), and the detector's reading of the stop."""
    choice = result.outputs[0]
    if not choice.logprobs:
        return {}
    from spectie.tools import tiestop  # stdlib only, like this module

    [completion] = tiestop.from_request_output(result)
    top2 = [tiestop.runner_up(step)[1] for step in completion.steps]
    verdict = tiestop.check(completion, threshold=0.0)
    stop = ({"position": verdict.position, "stop_token": verdict.stop_token, "runner_up": verdict.runner_up,
             "margin": verdict.margin} if verdict.margin is not None else None)
    return {"top2_margins": [round(m, 5) for m in top2], "stop_margin": stop}


def run(request: dict) -> None:
    phase = "import"
    try:
        import vllm
        from vllm import LLM, SamplingParams

        emit("started", vllm_version=vllm.__version__)
        phase = "engine"
        started = time.monotonic()
        llm = LLM(**request["llm_kwargs"])
        config = llm.llm_engine.vllm_config
        emit("engine_ready", seconds=round(time.monotonic() - started, 2),
             model_runner=model_runner(vllm.__version__, getattr(config, "use_v2_model_runner", None)),
             platform=str(config.device_config.device_type) if config.device_config else None)
        phase = "generate"
        tokenizer = llm.get_tokenizer()
        sampling = SamplingParams(**request["sampling"])
        # The matrix sends its prompts one request at a time (`sequential`, as the incident ran them);
        # a survey sends them as one batch per repeat.
        prompts = [{"prompt_token_ids": ids} for ids in request.get("prompts") or [request["prompt_token_ids"]]]
        batches = [[(n, p)] for n, p in enumerate(prompts)] if request.get("sequential") else [list(enumerate(prompts))]
        tail = request.get("tail_tokens", 8)
        for index in range(request["repeats"]):
            for batch in batches:
                before = spec_counters(llm)
                started = time.monotonic()
                results = llm.generate([p for _, p in batch], sampling, use_tqdm=False)
                seconds = round(time.monotonic() - started, 3)
                speculation = difference(spec_counters(llm), before)  # of the whole batch
                for (number, _), result in zip(batch, results):
                    output = result.outputs[0]
                    ids = list(output.token_ids)
                    emit("repeat", index=index, prompt=number, seconds=seconds,
                         finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                         token_ids=ids, token_hash=token_hash(ids), output_tokens=len(ids),
                         tail_tokens=tokenizer.convert_ids_to_tokens(ids[-tail:]),
                         tail_text=output.text[-160:], speculation=speculation, **margins(result))
        emit("done")
    except BaseException as error:  # recorded by the parent; the matrix goes on
        lines = traceback.format_exc().strip().splitlines()
        emit("error", phase=phase, type=type(error).__name__, message=str(error)[-2000:],
             traceback_tail=lines[-25:])
        sys.exit(1)


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"]:
        emit("probe", **probe())
        return 0
    if len(argv) == 2 and argv[0] == "run":
        with open(argv[1], encoding="utf-8") as handle:
            run(json.load(handle))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
