"""An operator's own request, diagnosed: the book's analysis on their model, release and prompt.

The request is the JSON body of an OpenAI completion or chat request, `{"prompt_token_ids": [...]}`, or a line of a
JSONL log holding `{"request": {...}, "response": {...}}` (the response that stopped, read by the tie-stop detector).
It runs through the same code as the chapters: plain greedy and the speculative configurations (the request's own
`speculative_config`, else the environment's matrix) through vLLM, repeated; the classifier on each divergence from
plain greedy; the detector on the stops vLLM served; the fix ledger for the installed release.

    plan = make_diagnosis("request.json", model="organism", environment="cpu")   # UsageError on anything wrong
    records = run(plan, results_dir)                                              # one record per configuration
    answers = findings(records, plan)                                             # the page's answers
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from spectie.engines.matrix import Matrix
from spectie.records.errors import UsageError

OPENAI_DEFAULT_MAX_TOKENS = 16  # what /v1/completions writes when a request names no max_tokens


@dataclass(frozen=True)
class Request:
    """What the diagnosis reads from the operator's request."""
    source: str  # the file (and line) it came from
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int = OPENAI_DEFAULT_MAX_TOKENS
    speculative_config: dict | None = None  # {"method": ..., "num_speculative_tokens": ...}
    response: dict | None = None  # the OpenAI response that stopped, where the log line holds it


def _line(path: Path, line: int | None) -> tuple[dict, str]:
    """The JSON object of the file (a .json body), or of its `line` (1-based; default the first) in a JSONL log."""
    if not path.is_file():
        raise UsageError(f"no such request file: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [(n, s) for n, s in enumerate(text.splitlines(), 1) if s.strip()]
    if line is None and (path.suffix == ".json" or len(lines) <= 1):
        chosen, where = text, str(path)
    else:
        found = [s for n, s in lines if n == (line or lines[0][0])] if lines else []
        if not found:
            raise UsageError(f"{path}: no line {line} (it has {len(text.splitlines())})")
        chosen, where = found[0], f"{path}:{line or lines[0][0]}"
    try:
        body = json.loads(chosen)
    except (json.JSONDecodeError, RecursionError):
        raise UsageError(f"{where}: not a JSON object") from None
    if not isinstance(body, dict):
        raise UsageError(f"{where}: not a JSON object, a {type(body).__name__}")
    return body, where


def _token_ids(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise UsageError(f"{where}: expected a non-empty list of token ids (integers >= 0)")
    return tuple(value)


def _speculative(body: dict, where: str) -> dict | None:
    config = body.get("speculative_config")
    if config is None:
        return None
    k = config.get("num_speculative_tokens") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("method"), str) or not isinstance(k, int) or k < 1:
        raise UsageError(f"{where}: speculative_config needs a method and num_speculative_tokens >= 1")
    return {"method": config["method"], "num_speculative_tokens": k}


def read_request(path: str | Path, line: int | None = None) -> Request:
    """The request in `path` (see the module's docstring); bad input is a UsageError naming where."""
    body, where = _line(Path(path), line)
    response = body.get("response") if "request" in body else None
    if "request" in body:
        body = body["request"]
        if not isinstance(body, dict):
            raise UsageError(f"{where}: 'request' is not a JSON object")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", OPENAI_DEFAULT_MAX_TOKENS))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise UsageError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if response is not None and not isinstance(response, dict):
        raise UsageError(f"{where}: 'response' is not a JSON object")
    common = dict(source=where, max_tokens=max_tokens, speculative_config=_speculative(body, where), response=response)
    if "prompt_token_ids" in body:
        return Request(prompt_token_ids=_token_ids(body["prompt_token_ids"], f"{where}: prompt_token_ids"), **common)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return Request(prompt_token_ids=_token_ids(prompt, f"{where}: prompt"), **common)
    if isinstance(prompt, str) and prompt:
        return Request(prompt=prompt, **common)
    messages = body.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return Request(messages=tuple(messages), **common)
    raise UsageError(f"{where}: no prompt: give 'prompt' (text or token ids), 'prompt_token_ids', or 'messages' "
                     "(each with a role and text content)")


def prompt_ids(request: Request, model_path: str) -> list[int]:
    """The request's prompt as the model's token ids (chat messages through the model's chat template)."""
    from spectie.lab.tokenizer import model_tokenizer

    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
    else:
        tokenizer = model_tokenizer(model_path)
        if request.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise UsageError(f"{request.source}: a chat request, but the model's tokenizer has no chat template")
            text = tokenizer.apply_chat_template(list(request.messages), tokenize=False, add_generation_prompt=True)
        else:
            text = request.prompt
        ids = tokenizer.encode(text, add_special_tokens=False)
        size = len(tokenizer)
        if any(t >= size for t in ids):
            raise UsageError(f"{request.source}: token ids beyond the tokenizer's {size}")
    return ids


def request_matrix(matrix: Matrix, request: Request, repeats: int) -> Matrix:
    """The configurations to run: plain greedy (the matrix's baseline) and the request's own speculative
    configuration, else every speculative configuration of the matrix that is expected to run; each with the
    request's max_tokens and `repeats` repeats, greedy."""
    base = next(c for c in matrix.configs if c.id == matrix.baseline)
    runnable = [c for c in matrix.configs if c.id != matrix.baseline and c.expect in ("ok", "ok-or-crashed")]
    if request.speculative_config is not None:
        method, k = request.speculative_config["method"], request.speculative_config["num_speculative_tokens"]
        same = [c for c in runnable if c.method == method]
        like = next((c for c in same if c.k == k), same[0] if same else base)
        runnable = [replace(like, id=f"request-{method}-k{k}", method=method, k=k, expect="ok")]
    configs = tuple(replace(c, max_tokens=request.max_tokens, repeats=repeats, temperature=0.0, ignore_eos=False)
                    for c in [base, *runnable])
    return replace(matrix, name=f"diagnose-{request_label(request.source)}-{matrix.name}", configs=configs)


def request_label(source: str) -> str:
    """A request's name in its records' ids, so that diagnoses of different requests can share one results folder:
    the file's name in letters, digits and dashes, and the line of a JSONL log ("log.jsonl:3" -> "log-line-3")."""
    name, _, line = Path(source).name.partition(":")
    return page_name(name) + (f"-line-{line}" if line else "")


@dataclass(frozen=True)
class Diagnosis:
    """What a diagnosis runs, checked: the request, the environment, the configurations, the model, the prompt."""
    request: Request
    environment: dict
    matrix: Matrix
    extra_engine: dict
    model_path: str
    model_label: str
    probe: dict
    prompt: tuple[int, ...]
    device: str  # where the classifier's fp32 reference runs

    def describe(self) -> str:
        configs = ", ".join(c.id for c in self.matrix.configs)
        return (f"request {self.request.source}: {len(self.prompt)} prompt tokens, max_tokens "
                f"{self.request.max_tokens}; vLLM {self.probe['vllm_version']} on {self.probe['platform']}; model "
                f"{self.model_label}; configurations {configs}, {self.matrix.configs[0].repeats} repeats each")


def check_device(device: str) -> None:
    """The classifier's device must be one this host has."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("device cuda: this host has no CUDA GPU that torch can use; give device cpu")


def make_diagnosis(request_path: str | Path, model: str = "organism", environment: str = "cpu", *,
                   line: int | None = None, repeats: int = 10, device: str = "cpu",
                   parallel: int | None = None) -> Diagnosis:
    """Everything a diagnosis needs, checked in order of cost (the request, the device, the environment, the model,
    the installed vLLM, the prompt against the engines' context): a UsageError before any weight loads. `parallel`:
    engines at once (None: the environment's matrix's own)."""
    from spectie.lab import qwen_shapes
    from spectie.engines import checks
    from spectie.engines.plan import choose_matrix, extra_engine_arguments
    from spectie.engines.checks import check_installed
    from spectie.records.environments import get_environment
    from spectie.lab.model import resolve_model

    request = read_request(request_path, line)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise UsageError(f"repeats must be an integer >= 1, got {repeats!r}")
    check_device(device)
    env = get_environment(environment)
    matrix = request_matrix(choose_matrix(env, "auto", parallel=parallel), request, repeats)
    extra = extra_engine_arguments(env, {}, 1)
    checks.check_devices(env, 1)
    matrix, extra = checks.split_over_cores(env, matrix, extra)
    model_path = resolve_model(model)
    probe = checks.probe_vllm(environment)
    check_installed(env, probe)
    checks.check_matrix(matrix, probe, extra)
    ids = prompt_ids(request, model_path)
    limit = {**matrix.engine, **extra}.get("max_model_len") or 0
    if len(ids) + request.max_tokens > limit:  # the engines' context is sized for the prompt and its new tokens
        extra = {**extra, "max_model_len": len(ids) + request.max_tokens}
    return Diagnosis(request, env, matrix, extra, model_path, qwen_shapes.model_label(model, model_path), probe,
                     tuple(ids), device)


def run(diagnosis: Diagnosis, results_dir: Path, content_hash: str | None = None, progress: bool = True) -> list:
    """Every configuration through vLLM on the request's prompt (plain greedy first), written under `results_dir`
    as the reproduce chapter's records are; an interrupted diagnosis resumes where it stopped. `content_hash`: what
    the records say made them (the executed page's stamp; default a digest of the request and the model)."""
    import hashlib

    from spectie.engines.matrix_run import run_matrix

    made_of = json.dumps([list(diagnosis.prompt), diagnosis.request.max_tokens, diagnosis.model_label])
    content_hash = content_hash or hashlib.sha256(made_of.encode()).hexdigest()

    return run_matrix(diagnosis.matrix, diagnosis.model_path, {0: list(diagnosis.prompt)},
                      diagnosis.environment["id"], diagnosis.probe, content_hash, extra_engine=diagnosis.extra_engine,
                      model_label=diagnosis.model_label, progress=progress, results_dir=results_dir)


DIAGNOSED = "examples/requests/diagnosed"  # committed diagnoses: <request>/results/, a folder per environment and host


def diagnosed_elsewhere(request_path: str | Path, here: list) -> list:
    """The same request's committed diagnoses by other environments or hosts (DIAGNOSED/<request>/results/), this
    run's own records left out: what the page shows beside its own verdict."""
    from spectie.records.paths import project_root
    from spectie.records.store import load_records

    folder = project_root() / DIAGNOSED / page_name(request_path) / "results"
    own = {r.id for r in here}
    return [r for r in load_records(folder, chapter="reproduce") if r.id not in own] if folder.is_dir() else []


def page_name(request_path: str | Path) -> str:
    """A diagnosis's folder name under _build/diagnose/: the request file's name, in letters, digits and dashes."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", Path(request_path).stem.lower()).strip("-") or "request"


def write_page(request_path: str | Path, model: str = "organism", environment: str = "cpu", *, line: int | None = None,
               repeats: int = 10, device: str = "cpu", name: str | None = None, out: Path | None = None,
               parallel: int | None = None, log=print) -> Path:
    """Check everything (`make_diagnosis`, and this host against the environment), then execute the diagnosis page
    (notebooks/diagnose.ipynb) into `out` (default _build/diagnose/<name>/) with its records beside it, and render
    it as HTML where jupyter-book is installed: the page's path (the HTML, else the executed notebook)."""
    import subprocess
    import sys

    from spectie.lab import host
    from spectie.book.run import execute
    from spectie.records.chapters import Chapter
    from spectie.records.paths import project_root

    diagnosis = make_diagnosis(request_path, model, environment, line=line, repeats=repeats, device=device,
                               parallel=parallel)
    for said in host.check("reproduce", diagnosis.environment, {"model": model, "device": device}):
        log(f"host check: {said}")
    log(diagnosis.describe())
    book = Path(sys.prefix) / "bin" / "jupyter-book"
    if not book.exists():
        log(f"jupyter-book is not installed in {sys.prefix}: the page will be an executed notebook, not HTML")
    root = project_root()
    out = out or root / "_build" / "diagnose" / (name or page_name(request_path))
    parameters = {"request": str(Path(request_path).resolve()), "line": line, "model": model,
                  "environment": environment, "repeats": repeats, "device": device, "parallel": parallel,
                  "results_dir": str(out / "results")}
    page = execute(Chapter("diagnose", "notebooks/diagnose.ipynb", (), "one request, diagnosed"), parameters,
                   output=out / "diagnose.ipynb")
    if not book.exists():  # a serving host's minimal install: the executed notebook is the page
        log(f"executed page: {page}\nrecords: {out / 'results'}\nno HTML: jupyter-book is not installed in "
            f"{sys.prefix} (make setup installs it); the executed notebook holds the verdict")
        return page
    built = subprocess.run([str(book), "build", page.name, "--config", str(root / "_config.yml"), "--path-output",
                            str(out)], cwd=out, capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"jupyter-book could not render {page}:\n{built.stdout[-2000:]}{built.stderr[-2000:]}")
    html = out / "_build" / "_page" / "diagnose" / "html" / "diagnose.html"
    log(f"executed page: {page}\nrecords: {out / 'results'}\npage: {html}")
    return html
