"""The operator's tools as a package of their own: the project's wheel in a clean venv (no extras, no book, no torch)
gives `spectie guard`, `fixes` and `tiestop`, and `classify` says which extra it needs."""

import json
import subprocess
import sys
import venv

import pytest

from spectie.records.paths import project_root

from test_tiestop import completion_response


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory):
    """A fresh venv (no system site packages) with the project's wheel and its required dependencies only."""
    folder = tmp_path_factory.mktemp("operator")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(folder / "wheel"), str(project_root())], check=True, capture_output=True)
    [wheel] = (folder / "wheel").glob("spectie-*.whl")
    venv.create(folder / "venv")  # without pip: this environment's pip installs into it (`pip --python`)
    subprocess.run(pip(folder, "install", "-q", "--no-compile", str(wheel)), check=True, capture_output=True)
    return folder


def pip(folder, *args) -> list[str]:
    """The pip command that acts on the venv in `folder`."""
    return [sys.executable, "-m", "pip", "--python", str(folder / "venv" / "bin" / "python"),
            "--disable-pip-version-check", *args]


def spectie(folder, *args):
    """The installed command, run outside the checkout (nothing of the project's folder is on its path)."""
    return subprocess.run([str(folder / "venv" / "bin" / "spectie"), *args], cwd=folder, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(folder)})


def test_the_wheel_alone_serves_the_operators_tools(operator_venv):
    installed = subprocess.run(pip(operator_venv, "list", "--format", "json"), capture_output=True, text=True,
                               check=True).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert not names & {"torch", "vllm", "papermill", "jupyter-book", "matplotlib"}, names
    result = spectie(operator_venv, "guard", "--help")
    assert result.returncode == 0 and "guard serve --upstream" in result.stdout, result.stderr
    result = spectie(operator_venv, "fixes", "--vllm", "0.31.0")
    assert result.returncode == 0, result.stderr
    assert "vLLM 0.31.0 (ledger of the official wheels" in result.stdout and "51812" in result.stdout
    responses = operator_venv / "responses.jsonl"
    responses.write_text(json.dumps(completion_response({"": -0.60, "DATA": -0.79})) + "\n")
    result = spectie(operator_venv, "tiestop", str(responses), "--threshold", "0.5")
    assert result.returncode == 1 and "FLAGGED  responses.jsonl:1/0" in result.stdout, result.stderr
    runs = project_root() / "results" / "measured" / "v0.32.0-h100-5bce98f73f3e" / "reproduce"
    for name in ("plain", "mtp-v1-k1"):  # a speculative run and the plain greedy run it is compared with
        source = runs / f"reproduce-v0.32.0-h100-incident-{name}-s0-5bce98f73f3e.json"
        (operator_venv / source.name).write_text(source.read_text())
    result = spectie(operator_venv, "classify", "--record", str(operator_venv / source.name))
    assert result.returncode == 2 and "pip install 'spectie[classify]'" in result.stderr, result.stderr
