import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
# vLLM importable in this environment (the CPU build after `make setup`; no vLLM on a GPU host's project venv)
HAS_VLLM = subprocess.run([sys.executable, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"],
                          capture_output=True).returncode == 0
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under pytest-xdist; None in a single process
# Each test worker computes on one thread and starts its vLLM CPU engines on a core of its own: two engines that
# both bind to core 0 (vLLM's automatic binding), or OpenMP threads of two workers on one core, spin against each
# other. (A build that measures this host from nothing places its survey engines itself, one per core.)
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(WORKER.removeprefix("gw")) % (os.cpu_count() or 1))

# The test files that take longest (pytest --durations), first: the workers take whole files in this order, so the
# long ones start at once and the workers end together instead of one waiting for the other's last long file.
SLOW_FILES = ["test_reproduce.py", "test_served.py", "test_book.py", "test_divergence.py", "test_qwen_shapes.py",
              "test_reduction_order.py", "test_cli_fuzz.py", "test_organism.py", "test_guard.py", "test_host_survey.py",
              "test_chapters.py"]



def stand_in_host() -> str | None:
    """The host of the cpu environment whose committed measurements the tests' book build renders where the records
    know no machine of this one's hardware (SPECTIE_STAND_IN_HOST, `fingerprint.key_hardware`): measuring this
    machine from nothing takes `make build` about ten minutes on two cores, more than the whole suite may take. A
    host of this CPU's maker where there is one. None where this machine or its hardware has records. Under
    SPECTIE_OWN_RECORDS_ONLY=1 (`NEW_HOST=1 scripts/time_pipeline.sh`: this machine as hardware new to the records)
    a host of other hardware stands in, as it would on new hardware. The tests that need this hardware's own near
    ties skip where the survey they read was made on other hardware (`made_on_other_hardware`)."""
    from spectie.records.fingerprint import STAND_IN, device, hardware, recorded_hardware
    from spectie.records.store import OWN_RECORDS_ONLY

    if os.environ.get(STAND_IN):
        return os.environ[STAND_IN]
    if own_records(ROOT, "reproduce/*.json"):
        return None  # this machine's own measurements (its `make build`), or those of identical hardware
    as_new = os.environ.get(OWN_RECORDS_ONLY) == "1"
    here = device(hardware())
    hosts = {host: device(found) for host, found in recorded_hardware(ROOT / "results").items()
             if (ROOT / "results" / "measured" / f"cpu-{host}").is_dir()}
    if not as_new and here in hosts.values():
        return None
    others = sorted((host for host, found in hosts.items() if found != here),
                    key=lambda host: not hosts[host]["cpu"].startswith(here["cpu"].split()[0]))
    if others:
        os.environ.pop(OWN_RECORDS_ONLY, None)  # the stand-in's records are reused: nothing of this host is measured
    return others[0] if others else None


def made_on_other_hardware(survey) -> str | None:
    """Why a test that serves this hardware's own near tie cannot, where the survey it reads was made on other
    hardware (a stand-in's); None where the survey is this hardware's."""
    from spectie.records.fingerprint import hardware, same_device

    if same_device(survey.fingerprint, on=hardware()):
        return None
    return (f"the survey the tests read ({survey.id}) was made on other hardware ({survey.fingerprint.cpu}): "
            "this machine's near ties are its own ('make build' measures its survey)")


def own_records(root: Path, pattern: str) -> list[Path]:
    """The record files matching `pattern` inside a host's folder of the cpu environment ("margins/*.json") that
    stand for this machine in `root`'s results: each record as this host has it, else as the first host of identical
    hardware has it, whose record a build here reuses instead of measuring again (`records.standing_hosts`)."""
    from spectie.records.store import standing_hosts

    found: dict[str, Path] = {}
    for host in standing_hosts("cpu", root / "results"):
        for path in (root / "results" / "measured" / f"cpu-{host}").glob(pattern):
            found.setdefault(path.name.replace(host, "<host>"), path)
    return sorted(found.values(), key=lambda path: path.name)


if STAND_IN_HOST := stand_in_host():
    os.environ["SPECTIE_STAND_IN_HOST"] = STAND_IN_HOST


def this_hosts_records(request, pattern: str) -> list[Path]:
    """This host's record files matching `pattern` ("margins/*.json"; see own_records): the checkout's own where
    this host's (or an identical host's) are committed, else those the book's build measured (the `built` fixture,
    which is then built; a test that reads one record does not wait for the whole book otherwise). On hardware that
    no record knows, the stand-in host's (`stand_in_host`): what the tests' build renders there."""
    return own_records(ROOT, pattern) or own_records(request.getfixturevalue("built")[0], pattern)


def this_hosts_survey(request):
    """This host's tie-stop survey record (vLLM's CPU build on the organism, plain and MTP)."""
    from spectie.records.store import read_record

    [path] = this_hosts_records(request, "guidance/tiestop-survey-cpu-*.json")
    return read_record(path)


def survey_near_tie(record, threshold: float):
    """The survey's first completion, MTP-K1's or else plain greedy's, that ends on end-of-text within `threshold`
    logits of its runner-up: (configuration, (tokens, seed), the stop), or None. Which decoding stops at a tie
    depends on the CPU's kernels (on an AMD EPYC MTP-K1 stopped where plain wrote on; on an Intel Xeon plain
    stopped where MTP-K1 wrote on): the survey says where the ties fell on this host."""
    for configuration in ("mtp-k1", record.parameters.baseline):
        for row in record.results.prompts:
            completion = row["completions"].get(configuration)
            stop = completion and completion["finish_reason"] == "stop" and completion["stop_margin"]
            if stop and stop["stop_token"].startswith("<|endoftext|>") and 0 <= stop["margin"] <= threshold:
                return configuration, (row["tokens"], row["seed"]), stop
    return None


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


@pytest.fixture
def reported_record():
    """A valid reported record (a copy of one of the incident's)."""
    return json.loads((ROOT / "results/reported/incident/v032-mtp-k8.json").read_text())


@pytest.fixture
def measured_record():
    from spectie.records.fingerprint import now
    from spectie.records.store import measured_record

    return measured_record(  # a valid measured record as it is written (a dict): a margin scan made on this host
        record_id="test-measured", kind="margin-scan", chapter="incident", title="a test record",
        environment="cpu", parameters={"model": "organism"},
        results={"rows": [], "output_ids": [], "finish_reason": "length"}, started_at=now(),
        content_hash="0" * 64, dtype="bfloat16",
    )


def typed(record: dict):
    """A test's partial record (the fields the code under test reads) as a Record: the rest filled in."""
    from spectie.records.record_types import Record

    return Record.from_dict({"schema_version": 1, "id": "a-test-record", "provenance": "measured",
                             "kind": "engine-outcome", "chapter": "reproduce", "title": "a test record",
                             "environments": ["cpu"], "parameters": {}, "results": {}, **record})


@pytest.fixture
def deep_copy():
    return copy.deepcopy


def copy_project(destination: Path, probes: bool = False) -> Path:
    """Copy the project's own files (tracked or not ignored) into `destination`, as a clone would have. `probes`:
    with this checkout's kept vLLM probes (_build/probes: one per installation, keyed by what it read), so a
    copy that runs engines does not probe the same installation again."""
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if probes and (ROOT / "_build" / "probes").is_dir():
        shutil.copytree(ROOT / "_build" / "probes", destination / "_build" / "probes")
    return destination


@pytest.fixture
def project_copy(tmp_path, monkeypatch):
    """A copy of the project that the code under test treats as the project root."""
    root = copy_project(tmp_path / "project")
    monkeypatch.setenv("SPECTIE_ROOT", str(root))
    return root


def make(target, root, *args):
    return subprocess.run(["make", target, f"VENV={Path(sys.prefix)}", *args], cwd=root,
                          capture_output=True, text=True, timeout=1800)  # a whole build: ~12 min uncontended


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """`python -m spectie <argv>` in this process (spectie.cli.main: the same parser, output and exit codes, without
    starting Python and torch again); test_cli.py runs the entry point as a process."""
    from spectie import cli

    return run_main(cli.main, *argv)


def run_main(main, *argv: str) -> subprocess.CompletedProcess:
    """A command line's `main(argv)` in this process, its exit code and what it printed."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # --help, and argparse's usage errors
            code = exc.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def stale_chapters(root: Path) -> tuple[list[str], str]:
    """The chapters `spectie stale` names in the project at `root`, and its output."""
    result = subprocess.run([str(Path(sys.prefix) / "bin" / "python"), "-m", "spectie", "stale"], cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split()[1].rstrip(":") for line in result.stdout.splitlines() if line.startswith("stale")], result.stdout


def shared_dir(tmp_path_factory) -> Path:
    """A folder every test worker of this run sees (pytest-xdist gives each worker its own basetemp inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """A copy of the project, built once for every test that reads the book or the records a build writes (once per
    run: the first test worker to need it builds, the others wait and read what it wrote). The chapters' executed
    copies of this checkout go with it: where they are current the build executes nothing (a fresh clone has none,
    so there, as in CI, every chapter is executed from clean). The measured records are the checkout's own
    (committed): a chapter reuses this host's record (or one of a host of identical hardware) of a measurement that
    did not change and measures what did, as `make build` does."""
    if not (Path(sys.prefix) / "bin" / "jupyter-book").exists():
        pytest.fail("run the tests from the project's environment (make test)")
    shared = shared_dir(tmp_path_factory)
    kept = shared / "built.json"
    with FileLock(shared / "built.lock"):
        if not kept.is_file():
            root = copy_project(tmp_path_factory.mktemp("clean") / "project")
            assert not (root / "_build").exists()
            for executed in sorted((ROOT / "book" / "generated").glob("*.ipynb")):
                (root / "book" / "generated").mkdir(parents=True, exist_ok=True)
                shutil.copy2(executed, root / "book" / "generated" / executed.name)
            (root / "artifacts").symlink_to(ROOT / "artifacts")  # built by `make setup`, like the environment
            stale, _ = stale_chapters(root)
            result = make("build", root)
            kept.write_text(json.dumps({"root": str(root), "stale": stale, "args": result.args,
                                        "returncode": result.returncode, "stdout": result.stdout,
                                        "stderr": result.stderr}))
    done = json.loads(kept.read_text())
    result = subprocess.CompletedProcess(done["args"], done["returncode"], done["stdout"], done["stderr"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Path(done["root"]), result, done["stale"]
