"""Command line: `python -m spectie <command>` (the Makefile calls these).

Exit codes, for every command: 0 checked, nothing found; 1 a finding (tiestop: a stop flagged as a near-tie;
classify: a suspected correctness bug); 2 bad input or usage (one line naming the file and where); 3 an
internal error (a bug in spectie: its traceback, then one line)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from spectie.records.errors import UsageError


def _input_problems(results_dir=None) -> list[str]:
    """Every broken record, duplicated id, or record naming an unknown environment."""
    from spectie.records.environments import check_record_environments, load_environments
    from spectie.records.store import check_records

    load_environments()  # raises on a malformed environment file
    records, problems = check_records(results_dir)
    return [str(p) for p in problems] + check_record_environments(records)


def _check_inputs() -> None:
    """Fail before any notebook runs if a record or an environment file is broken."""
    problems = _input_problems()
    if problems:
        raise UsageError(problems[0])


def _cmd_build(args) -> int:
    from spectie.book.run import build_stale
    from spectie.records.fingerprint import ENTRY_VARIABLE

    _check_inputs()
    os.environ[ENTRY_VARIABLE] = "spectie build (make build)"
    ran = build_stale(progress=not args.quiet)
    print(f"executed {len(ran)} chapter(s): {', '.join(ran) if ran else 'none (all up to date)'}")
    return 0


def _cmd_run(args) -> int:
    """Check the host against the environment, then execute the chapter. SPECTIE_STRICT_HOST=1 makes the
    host check strict: a driver other than the one the environment names is refused, not just recorded."""
    from spectie.book.run import execute, get_chapter, load_parameters, notebook_parameters
    from spectie.lab import host
    from spectie.records.environments import get_environment
    from spectie.records.fingerprint import ENTRY_VARIABLE, host_id
    from spectie.records.paths import project_root

    chapter = get_chapter(args.chapter)
    overrides = dict(args.set or [])
    if args.env:
        get_environment(args.env)
        if "environment" in notebook_parameters(chapter):  # chapters that measure take it as a parameter
            overrides.setdefault("environment", args.env)
    _check_inputs()
    parameters = load_parameters(chapter, args.params, overrides)
    effective = {**notebook_parameters(chapter), **parameters}
    environment = get_environment(str(effective.get("environment") or args.env or "cpu"))
    strict = os.environ.get("SPECTIE_STRICT_HOST") == "1"
    for line in host.check(chapter.name, environment, effective, strict=strict):  # before anything heavy starts
        print(f"host check: {line}")
    output = Path(args.output) if args.output else project_root() / "_build" / "runs" / f"{chapter.name}.ipynb"
    print(f"running chapter {chapter.name!r} with parameters {parameters or '(defaults)'}")
    os.environ[ENTRY_VARIABLE] = "spectie run (make run)"  # the notebook's records say how they were made
    if "environment" in effective:
        print(f"records go to results/measured/{environment['id']}-{host_id()}/{chapter.name}/")
    execute(chapter, parameters, output=output)
    print(f"executed notebook: {output}")
    return 0


def _cmd_diagnose(args) -> int:
    from spectie.book.diagnose import write_page

    write_page(args.request, args.model, args.env, line=args.line, repeats=args.repeats, device=args.device,
               name=args.name)
    return 0


def _cmd_venv(args) -> int:
    """.venvs/<env> with the environment's vLLM; a commit-pinned environment takes the commit's full hash
    from VLLM_COMMIT."""
    from spectie.engines.venvs import create_venv

    create_venv(args.env, wheels=args.wheels, commit=os.environ.get("VLLM_COMMIT"))
    return 0


def _cmd_stale(args) -> int:
    """Each chapter, in build order: up to date, or stale and why (its new, changed or gone inputs). A chapter
    that an earlier stale one writes records for may turn stale only once that one has run."""
    from spectie.book.run import CHAPTERS, reasons_text, stale_reasons

    for chapter in CHAPTERS.values():
        reasons = stale_reasons(chapter)
        print(f"{'stale' if reasons else 'up to date':11} {chapter.name}" +
              (f": {reasons_text(reasons, 1000 if args.all else 3)}" if reasons else ""))
    return 0


def _cmd_check(args) -> int:
    from spectie.records.paths import project_root
    from spectie.records.store import record_paths

    found = record_paths(args.results_dir)
    if not found:  # a check that checked nothing has not passed
        where = Path(args.results_dir) if args.results_dir else project_root() / "results"  # as record_paths reads it
        print(f"error: no records found under {where}" + ("" if where.is_dir() else " (no such folder)"),
              file=sys.stderr)
        return 2
    messages = _input_problems(args.results_dir)
    for message in messages:
        print(f"error: {message}", file=sys.stderr)
    print(f"{len(found)} record file(s), {len(messages)} problem(s)")
    return 1 if messages else 0


def _cmd_list(args) -> int:
    from spectie.records.chapters import CHAPTERS
    from spectie.records.environments import load_environments

    print("chapters:")
    for chapter in CHAPTERS.values():
        print(f"  {chapter.name:14} {chapter.summary}")
    print("environments:")
    for env in load_environments().values():
        print(f"  {env['id']:24} {env['title']}")
    return 0


def _cmd_tiestop(args) -> int:
    import json

    from spectie.tools import thresholds, tiestop
    from spectie.lab.model import resolve_model

    if not args.files and not args.record:
        raise UsageError("give JSONL files of responses, or --record <reproduction record>")
    completions = [c for path in args.files for c in tiestop.read_jsonl(path)]  # bad files fail first
    device = None
    if args.record:
        from spectie.records.store import read_record

        record = read_record(args.record)
        completions += tiestop.from_record(record)
        device = record.device  # the band of the device that served it, where recorded
        args.model = args.model or record.parameters.model
    model = resolve_model(args.model) if args.model else None
    if args.threshold is not None:
        threshold, origin = args.threshold, "given with --threshold"
    elif model:
        threshold, origin = thresholds.detector_threshold_for_model(model, device)
    else:
        threshold, origin = thresholds.default_threshold()
    stops = tiestop.end_of_text(model) if model else None
    verdicts = [tiestop.check(c, threshold, stops) for c in completions]
    if args.json:
        for verdict in verdicts:
            print(json.dumps(verdict.as_dict()))
    else:
        print(f"threshold {threshold:.3f} logits ({origin})")
        print(f"stop tokens: {stops.names()}" if stops else
              "stop tokens: not checked against the model's end-of-text tokens (give --model)")
        for v in verdicts:
            mark = "FLAGGED" if v.flagged else "UNREAD" if v.unread else "ok"
            where = f" at output token {v.position + 1}" if v.position is not None else ""  # counted from 1
            print(f"{mark:8} {v.request}{where}: {v.explanation}")
        flagged = sum(v.flagged for v in verdicts)
        unread = sum(v.unread for v in verdicts)
        print(f"{flagged} of {len(verdicts)} completion(s) flagged as near-tie stops"
              + (f"; {unread} stop(s) could not be read (their last token is not an end-of-text token)" if unread else ""))
    return FINDING if any(v.flagged for v in verdicts) else CHECKED


def _cmd_classify(args) -> int:
    import json

    from spectie.tools import divergence
    from spectie.records.store import read_record

    if args.record:
        pair = divergence.pair_from_records(read_record(args.record), divergence.baseline_record(args.record),
                                            args.repeat)
    else:
        pair = divergence.read_pair(args.pair)
    model = args.model or pair.get("model") or "organism"
    result = divergence.classify(model, pair["prompt_token_ids"], pair["a"], pair["b"], args.threshold, args.device)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        names = f"{pair.get('a_name', 'a')} vs {pair.get('b_name', 'b')}"
        print(f"{names}: {result.verdict}")
        print(f"  {result.explanation}")
        if result.position is not None:
            print(f"  fp32 margin {result.reference_margin:+.4f}, bf16 margin {result.serving_margin:+.4f}, "
                  f"fp32 ranks {result.rank_a} and {result.rank_b} (its top-1: {result.reference_top1!r}); "
                  f"threshold {result.threshold:.3f} ({result.threshold_origin})")
    return FINDING if result.verdict == divergence.Verdict.BUG else CHECKED


def _cmd_guard(args) -> int:
    """`guard run`: a batch of requests through the guard, responses to stdout or --out; `guard serve`: the proxy."""
    from spectie.tools import guard, guard_proxy

    if args.action == "run":
        requests = guard_proxy.read_requests(args.requests)  # every line checked before anything is sent
    elif not 0 < args.port < 65536:
        raise UsageError(f"--port must be a TCP port (1 to 65535), got {args.port}")
    checked = guard.open_guard(args.upstream, args.model, args.threshold, args.max_resumes)
    print(f"guard: {checked.upstream} serving {checked.served_model}; end-of-text {checked.stops.names()}; "
          f"threshold {checked.threshold:g} logits ({checked.threshold_origin}); at most {checked.max_resumes} "
          "resumes a completion", file=sys.stderr)
    if args.action == "serve":
        import uvicorn

        uvicorn.run(guard_proxy.create_app(checked), host=args.host, port=args.port, log_level="warning")
        return 0
    with (open(args.out, "w") if args.out else sys.stdout) as out:
        tally = guard_proxy.run_batch(checked, requests, out)
    print(f"guard: {tally['requests']} requests, {tally['resumed']} resumed near-tie stops "
          f"({tally['extra_requests']} extra requests), {tally['unchecked']} passed through unchecked", file=sys.stderr)
    return 0


def _cmd_fixes(args) -> int:
    import json

    from spectie.tools import fixes

    if args.vllm is not None:
        version, distribution = fixes.release_of(args.vllm), "vllm"  # an empty or malformed version is refused
    else:
        version, distribution = fixes.installed_version()
    if not version:
        raise UsageError("no vLLM is installed here: give the version to check with --vllm X.Y.Z")
    record = fixes.ledger_record()  # read from the committed ledger once the version is known good; writes nothing
    rows = fixes.fixes_for(record, version)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"vLLM {version} (ledger of the official wheels {record.parameters.releases[0]} to "
          f"{record.parameters.releases[-1]}, read {record.started_at[:10]}):")
    if distribution != "vllm":
        print(f"  (installed here: {distribution}, a community build; the ledger read the official wheels' source)")
    for row in rows:
        print(f"  {row['fix']}: {row['this release']} (first release with it: {row['first release with it']})")
        if row["failure"]:
            print(f"      {row['failure']}")
    return 0


CHECKED, FINDING, BAD_INPUT, INTERNAL_ERROR = 0, 1, 2, 3
EXIT_CODES = ("exit codes: 0 checked, nothing found; 1 a finding (a flagged stop, a suspected bug); 2 bad input or "
              "usage; 3 internal error")


GUARD_EPILOG = """examples:
  spectie guard serve --upstream http://127.0.0.1:8000 --model /models/Qwen3.5-27B --port 8001
      clients then call http://127.0.0.1:8001/v1/completions (or /v1/chat/completions) as before
  spectie guard run requests.jsonl --url http://127.0.0.1:8000 --model /models/Qwen3.5-27B --out responses.jsonl
exit codes: 0 done; 2 bad input or an upstream the guard cannot check (said before any request is sent)"""


def _key_value(text: str) -> tuple[str, object]:
    import yaml

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key, yaml.safe_load(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectie", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _chapter_commands(sub)
    _operator_commands(sub)
    _guard_command(sub)
    return parser


def _chapter_commands(sub) -> None:
    """build, run, venv, stale, check, list: the book's chapters, environments and records."""
    p = sub.add_parser("build", help="execute every stale chapter into book/generated/")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("run", help="execute one chapter with parameters on this host")
    p.add_argument("chapter", help="chapter name (see `spectie list`)")
    p.add_argument("--params", help="YAML file of parameters")
    p.add_argument("--set", action="append", type=_key_value, metavar="NAME=VALUE",
                   help="one parameter (YAML value); may be repeated")
    p.add_argument("--env", help="environment id from environments/ this host stands for")
    p.add_argument("--output", help="where to write the executed notebook (default _build/runs/)")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("diagnose", help="one request that stopped early, through the book's analysis (a page)")
    p.add_argument("request", help="an OpenAI completion or chat request body, or a JSONL log line with its response")
    p.add_argument("--model", default="organism", help="the model folder (or hub id) it was served with")
    p.add_argument("--env", default="cpu", help="environment id from environments/ whose vLLM runs it")
    p.add_argument("--line", type=int, help="the line of a JSONL log (1-based)")
    p.add_argument("--repeats", type=int, default=10, help="repeats per configuration (default 10)")
    p.add_argument("--device", default="cpu", help="where the classifier's fp32 reference runs: cpu or cuda")
    p.add_argument("--name", help="the page's folder under _build/diagnose/ (default: the request file's name)")
    p.set_defaults(func=_cmd_diagnose)

    p = sub.add_parser("venv", help="create .venvs/<env> with that environment's official vLLM (GPU hosts)",
                       description="Create .venvs/<env> with the vLLM the environment pins: a release from PyPI "
                                   "(or from --wheels, offline), or the wheel of a main-branch commit (its full "
                                   "hash in the environment variable VLLM_COMMIT).")
    p.add_argument("env", help="environment id from environments/")
    p.add_argument("--wheels", metavar="DIR", help="install offline from this folder of wheels (a host without "
                   "internet whose torch is preinstalled: the venv sees the system's packages)")
    p.set_defaults(func=_cmd_venv)

    p = sub.add_parser("stale", help="say which chapters would be re-executed, and why")
    p.add_argument("--all", action="store_true", help="every reason, not the first three of each chapter")
    p.set_defaults(func=_cmd_stale)

    p = sub.add_parser("check", help="validate every record and environment file")
    p.add_argument("--results-dir", default=None, help="folder of records (default results/)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("list", help="list chapters and environments")
    p.set_defaults(func=_cmd_list)


def _operator_commands(sub) -> None:
    """tiestop, classify, fixes: the operator's tools."""
    p = sub.add_parser("tiestop", epilog=EXIT_CODES, help="flag completions whose stop token won by less than the noise band",
                       description="Flag completions (JSONL of OpenAI-compatible responses from vllm serve, "
                                   "requested with top-2 logprobs) whose stop token won by a margin inside the "
                                   "bf16 noise band: a near-tie stop that another computation shape could flip.")
    p.add_argument("files", nargs="*", help="JSONL files, one response per line")
    p.add_argument("--record", help="a reproduction record (results/measured/.../reproduce/*.json): each repeat's stop, "
                                    "from the top-2 margins vLLM served (its model, unless --model)")
    p.add_argument("--threshold", type=float, help="margin in logits up to which a stop is flagged (default: the band "
                                                   "recorded for --model's weights or one bf16 step at their recorded "
                                                   "logits, whichever is wider; else the incident's reported "
                                                   "fp32-vs-bf16 swing)")
    p.add_argument("--model", help="organism, a model folder or a hub id: its end-of-text tokens are the only stop "
                                   "tokens read, and (without --threshold) its recorded noise band is the threshold")
    p.add_argument("--json", action="store_true", help="one JSON verdict per line")
    p.set_defaults(func=_cmd_tiestop)

    p = sub.add_parser("classify", epilog=EXIT_CODES, help="is the first divergence of two greedy outputs a near-tie or a bug?",
                       description="Find the first divergence of two token sequences generated from one prompt and "
                                   "classify it with the fp32 reference: numerical near-tie (inside the noise band) "
                                   "or suspected correctness bug.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("pair", nargs="?", help="JSON file: prompt_token_ids, a, b (token id lists), optional model")
    source.add_argument("--record", help="a reproduction record: its repeat against its baseline's")
    p.add_argument("--repeat", type=int, default=0, help="which repeat of the records (default 0)")
    p.add_argument("--model", help="organism, a model folder or a hub id (default: the pair's or the record's)")
    p.add_argument("--threshold", type=float, help="noise band in logits (default: recorded band of the nearest size)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="the verdict as one JSON object")
    p.set_defaults(func=_cmd_classify)

    p = sub.add_parser("fixes", epilog=EXIT_CODES, help="which public fixes a vLLM release carries (the fix ledger)",
                       description="Which public fixes for GDN state and speculative-decoding failures a vLLM release "
                                   "carries, as read from the released wheels' source (sources/fix_ledger.md).")
    p.add_argument("--vllm", help="a vLLM version (default: the one installed here)")
    p.add_argument("--json", action="store_true", help="the rows as one JSON list")
    p.set_defaults(func=_cmd_fixes)


def _guard_command(sub) -> None:
    """guard: the workaround in front of vllm serve."""
    p = sub.add_parser("guard", epilog=GUARD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="resume near-tie end-of-text stops before they reach the client (vllm serve)",
                       description="In front of vllm serve: a greedy, non-streaming completion that ends on an "
                                   "end-of-text token by a margin inside the noise band (the detector's threshold) "
                                   "is continued from the runner-up token, and the response says so in a 'guard' "
                                   "field. Confident stops, stops on the caller's stop strings or stop token ids, and "
                                   "requests it cannot check (streaming, sampling, logit bias) are passed through "
                                   "unchanged. Cost: one more request per resumed stop; two logprobs per token.")
    common = argparse.ArgumentParser(add_help=False)  # options in any order around the requests file
    common.add_argument("--upstream", "--url", dest="upstream", required=True, help="base URL of vllm serve")
    common.add_argument("--model", required=True, help="the served model's folder (or organism, or a hub id in the "
                                                        "local cache): its end-of-text tokens and recorded band")
    common.add_argument("--threshold", type=float, help="margin in logits up to which a stop is resumed (default: "
                                                        "the detector's, as spectie tiestop --model chooses it)")
    common.add_argument("--max-resumes", type=int, default=4, help="resumes per completion at most (default 4)")
    actions = p.add_subparsers(dest="action", required=True, metavar="{run,serve}")
    run = actions.add_parser("run", parents=[common], help="a JSONL file of requests through the guard")
    run.add_argument("requests", help="JSONL file, one request body per line (or {path, body})")
    run.add_argument("--out", help="write the responses here (default: standard output)")
    serve = actions.add_parser("serve", parents=[common], help="the guard as a proxy in front of vllm serve")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    p.set_defaults(func=_cmd_guard)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The parser, built once per process (parsing leaves it as it was)."""
    return build_parser()


# Modules of the package's extras (pyproject.toml) -> (the extra, what to say it needs).
EXTRAS = {"torch": ("classify", "torch and transformers"), "papermill": ("book", "the book's stack"),
          "matplotlib": ("book", "the book's stack"), "pandas": ("book", "the book's stack"),
          "myst_nb": ("book", "the book's stack"), "vllm": ("book", "vLLM (make setup, or make venv ENV=...)")}
# Modules of the package's own dependencies (pyproject.toml) -> their distribution: missing, the install is incomplete.
DEPENDENCIES = {m: m for m in ("httpx", "fastapi", "uvicorn", "jsonschema", "transformers", "tqdm")} | {"yaml": "PyYAML"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # a usage error exits 2 (argparse)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader stopped reading (`spectie stale | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 0
    except ModuleNotFoundError as exc:  # an extra that is not installed (the operator's wheel alone), else a bug
        missing = (exc.name or "").split(".")[0]
        if missing in DEPENDENCIES:
            print(f"error: spectie {args.command} needs {DEPENDENCIES[missing]}, one of its dependencies, which is not "
                  f"installed for {sys.executable}: install spectie with its dependencies there", file=sys.stderr)
            return BAD_INPUT
        if missing not in EXTRAS:
            return _internal_error(exc)
        extra, modules = EXTRAS[missing]
        print(f"error: spectie {args.command} needs {modules}, which are not installed here: "
              f"pip install 'spectie[{extra}]' (or make setup in the book's checkout)", file=sys.stderr)
        return BAD_INPUT
    except Exception as exc:  # a bug, not bad input: say so, with what a report needs
        return _internal_error(exc)


def _internal_error(exc: Exception) -> int:
    import traceback

    traceback.print_exc()
    print(f"internal error: {type(exc).__name__}: {exc} (a bug in spectie; please report it with the traceback)",
          file=sys.stderr)
    return INTERNAL_ERROR
