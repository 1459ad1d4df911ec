"""`make venv`: which vLLM goes into .venvs/<env>, how it is fetched, and the check of what was installed.
No test installs anything or reaches the network: the commands are checked as built, and every run of
`make venv` / `spectie venv` happens in a copy of environments/ with pip kept off any index."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from spectie.records.environments import get_environment
from spectie.records.errors import UsageError
from spectie.engines.checks import check_installed
from spectie.engines.venvs import create_venv, expand, install_commands

FULL = "77154ca6" + "0123456789abcdef0123456789abcdef"  # a full hash of the nightly's commit (its shape)
NIGHTLY = "nightly-77154ca6-b200"


@pytest.fixture
def isolated_root(tmp_path, monkeypatch):
    """A project root holding only environments/, and pip with no index: a venv made by mistake lands
    here and no install reaches the network."""
    root = tmp_path / "root"
    shutil.copytree(ROOT / "environments", root / "environments")
    monkeypatch.setenv("SPECTIE_ROOT", str(root))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return root


def python_of(env_id: str) -> Path:
    return Path("/p/.venvs") / env_id / "bin" / "python"


# ------------------------------------------------------------------------------------ what to install
def test_an_environment_without_vllm_is_refused_with_those_that_pin_one():
    with pytest.raises(UsageError, match=r"'h200' pins no vLLM.*that pin one: .*v0\.31\.0-b200") as refused:
        install_commands(get_environment("h200"), python_of("h200"))
    assert NIGHTLY in str(refused.value) and "cpu" not in str(refused.value).split("pin one:")[1]
    with pytest.raises(UsageError, match=r"'cpu' pins no vLLM for \.venvs/: it uses the project's \.venv.*make setup"):
        install_commands(get_environment("cpu"), python_of("cpu"))


def test_a_release_comes_from_pypi():
    python = python_of("v0.31.0-b200")
    assert install_commands(get_environment("v0.31.0-b200"), python) == [
        [sys.executable, "-m", "venv", "/p/.venvs/v0.31.0-b200"],
        [str(python), "-m", "pip", "install", "vllm==0.31.0"],
    ]


def test_a_release_installs_offline_from_a_folder_of_wheels(tmp_path):
    for name in ("vllm-0.31.0-cp38-abi3-manylinux1_x86_64.whl", "xgrammar-0.2.7-cp312-cp312-manylinux.whl"):
        (tmp_path / name).write_bytes(b"")
    python = python_of("v0.31.0-b200")
    commands = install_commands(get_environment("v0.31.0-b200"), python, wheels=tmp_path)
    assert commands == [
        [sys.executable, "-m", "venv", "--system-site-packages", "/p/.venvs/v0.31.0-b200"],  # the host's torch
        [str(python), "-m", "pip", "install", "--no-index", "--no-deps", f"{tmp_path}/*.whl"],
    ]
    assert expand(commands[1])[-2:] == [str(tmp_path / "vllm-0.31.0-cp38-abi3-manylinux1_x86_64.whl"),
                                        str(tmp_path / "xgrammar-0.2.7-cp312-cp312-manylinux.whl")]
    with pytest.raises(UsageError, match=r"pins vLLM 0\.32\.0, but .* holds no vllm-0\.32\.0-\*\.whl"):
        install_commands(get_environment("v0.32.0-rtx4090"), python_of("v0.32.0-rtx4090"), wheels=tmp_path)
    with pytest.raises(UsageError, match="holds no vllm-0.31.0"):
        install_commands(get_environment("v0.31.0-b200"), python, wheels=tmp_path / "missing")


def test_a_commit_needs_its_full_hash():
    env = get_environment(NIGHTLY)
    for given in (None, "", "77154ca6", "0" * 40, FULL[:39], FULL + "0", FULL[:-1] + "z"):
        with pytest.raises(UsageError, match=r"git rev-parse 77154ca6.* in a clone .*VLLM_COMMIT=<full hash>"):
            install_commands(env, python_of(NIGHTLY), commit=given)
    with pytest.raises(UsageError, match="WHEELS .* is for environments that pin a release"):
        install_commands(env, python_of(NIGHTLY), wheels="/tmp", commit=FULL)


def test_a_commit_comes_from_its_own_index_alone():
    """With --extra-index-url pip merges the commit's index with PyPI and takes the newest version: a PyPI
    release, not the commit. Only the commit's index is searched, and the file downloaded is installed."""
    python = python_of(NIGHTLY)
    commands = install_commands(get_environment(NIGHTLY), python, commit=FULL.upper())
    wheelhouse = f"/p/.venvs/{NIGHTLY}/wheelhouse"
    assert commands == [
        [sys.executable, "-m", "venv", f"/p/.venvs/{NIGHTLY}"],
        [str(python), "-m", "pip", "download", "--no-deps", "--pre", "--index-url",
         f"https://wheels.vllm.ai/{FULL}/", "vllm", "-d", wheelhouse],
        [str(python), "-m", "pip", "install", f"{wheelhouse}/vllm-*.whl"],
    ]
    assert not any(a.startswith("--extra-index-url") or a == "--find-links" for c in commands for a in c)


def test_a_file_pattern_that_matches_nothing_is_said(tmp_path):
    with pytest.raises(UsageError, match=r"no file matches .*wheelhouse/vllm-\*\.whl"):
        expand(["pip", "install", str(tmp_path / "wheelhouse" / "vllm-*.whl")])


def test_nothing_is_created_for_what_cannot_be_installed(isolated_root):
    with pytest.raises(UsageError, match="VLLM_COMMIT"):
        create_venv(NIGHTLY)
    with pytest.raises(UsageError, match="unknown environment"):
        create_venv("no-such-env")
    assert not (isolated_root / ".venvs").exists()


# ---------------------------------------------------------------------------------- what was installed
def test_a_release_environment_needs_exactly_its_release():
    env = get_environment("v0.31.0-rtx4090x2")
    check_installed(env, {"vllm_version": "0.31.0", "vllm_commit": None})
    check_installed(env, {"vllm_version": "0.31.0+cu130"})  # a local build tag is the same release
    for other in ("0.32.0", "0.31.0rc1", "0.31.0.post1", "0.31"):
        with pytest.raises(UsageError) as refused:
            check_installed(env, {"vllm_version": other, "vllm_commit": None})
        assert str(refused.value) == (f"environment 'v0.31.0-rtx4090x2' pins vLLM 0.31.0, but the installed vLLM is "
                                      f"{other}: reinstall with `make venv ENV=v0.31.0-rtx4090x2`")


def test_a_nightly_environment_needs_its_commit():
    env = get_environment(NIGHTLY)
    check_installed(env, {"vllm_version": "0.11.1rc6.dev40+g77154ca6f.cu129"})  # commit from the version
    check_installed(env, {"vllm_version": "0.11.1rc6.dev40+g77154ca6f.cu129", "vllm_commit": None})
    check_installed(env, {"vllm_version": "0.11.1rc6.dev40", "vllm_commit": FULL})  # commit_id wins
    check_installed(env, {"vllm_version": "0.11.1rc6.dev40", "vllm_commit": "77154CA"})  # shorter than the pin
    with pytest.raises(UsageError, match=r"pins vLLM commit 77154ca6, but the installed vLLM "
                                         r"0\.11\.1rc6\.dev41\+gdeadbeef1 was built from commit deadbeef1"):
        check_installed(env, {"vllm_version": "0.11.1rc6.dev41+gdeadbeef1"})


def test_a_nightly_environment_holding_a_pypi_release_is_refused():
    env = get_environment(NIGHTLY)
    with pytest.raises(UsageError) as refused:
        check_installed(env, {"vllm_version": "0.32.0"})  # what --extra-index-url installed
    message = str(refused.value)
    assert f"environment '{NIGHTLY}' pins vLLM commit 77154ca6" in message and "installed vLLM 0.32.0" in message
    assert "cannot be determined" in message and f"make venv ENV={NIGHTLY} VLLM_COMMIT=<full hash>" in message
    release_commit = "0123456789abcdef0123456789abcdef01234567"  # a release wheel names its own commit
    with pytest.raises(UsageError, match=f"0.32.0 was built from commit {release_commit}: reinstall"):
        check_installed(env, {"vllm_version": "0.32.0", "vllm_commit": release_commit})


def test_an_environment_without_vllm_has_nothing_to_check():
    """An environment that pins no vLLM accepts whatever is installed; one that pins a release refuses another."""
    installed = {"vllm_version": "0.32.0", "vllm_commit": None}
    assert get_environment("h200")["vllm"] == {"version": None, "commit": None}
    assert check_installed(get_environment("h200"), installed) is None
    with pytest.raises(UsageError, match="0.31.0"):
        check_installed(get_environment("v0.31.0-h100"), installed)


# --------------------------------------------------------------------------------------- make venv
def make_venv(*variables, env=None):
    return subprocess.run(["make", "-s", "venv", *variables], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env or dict(os.environ))


def test_make_venv_without_setup_says_so(tmp_path):
    result = make_venv("ENV=v0.31.0-b200", f"VENV={tmp_path / 'no-venv'}")
    assert result.returncode == 2
    assert f"error: no environment in {tmp_path / 'no-venv'}: run 'make setup' first" in result.stderr
    assert "No such file" not in result.stderr


def test_make_venv_of_an_environment_without_vllm_says_so(isolated_root):
    result = make_venv("ENV=h200")
    assert result.returncode == 2
    assert "error: environment 'h200' pins no vLLM" in result.stderr and "v0.31.0-b200" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_venv_passes_wheels_and_the_commit_on(isolated_root, tmp_path):
    result = make_venv(f"ENV={NIGHTLY}", "VLLM_COMMIT=77154ca6")
    assert result.returncode == 2 and "VLLM_COMMIT='77154ca6' is not the full hash" in result.stderr
    result = make_venv("ENV=v0.31.0-b200", f"WHEELS={tmp_path}")
    assert result.returncode == 2 and f"but {tmp_path} holds no vllm-0.31.0-*.whl" in result.stderr
    assert not (isolated_root / ".venvs").exists()


def test_spectie_venv_of_an_environment_without_vllm_exits_2(isolated_root):
    result = subprocess.run([sys.executable, "-m", "spectie", "venv", "h200"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: environment 'h200' pins no vLLM (neither a version nor a commit)")
