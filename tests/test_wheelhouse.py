"""make wheelhouse: an environment's wheels for a GPU host without internet (the plan, the lock, the install
script, the parts). The download itself (1.3 GB for a locked environment) is not repeated here."""

import os
import stat
import subprocess

import pytest

from spectie.engines import wheelhouse
from spectie.records.environments import get_environment
from spectie.records.errors import UsageError


def test_a_locked_environment_downloads_exactly_its_lock_for_the_gpu_hosts_python():
    env = get_environment("v0.32.0-h200")
    command = wheelhouse.pip_download(env, "/tmp/wh/wheels")
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
    assert command[command.index("--python-version") + 1] == "3.12" and "--abi" in command and "cp312" in command
    assert "--platform=manylinux_2_39_x86_64" in command and "--platform=manylinux_2_40_x86_64" not in command
    pins, with_dependencies = wheelhouse.requirements(env)
    assert not with_dependencies and len(pins) == 67 and {"vllm==0.32.0", "torch==2.13.0", "nvidia-nccl-cu13==2.29.7", "uvicorn==0.55.0", "model-hosting-container-standards==0.1.16", "jsonschema==4.26.0"} <= set(pins)
    assert wheelhouse.requirements(get_environment("v0.31.0-h100"))[0].count("transformers==5.17.0") == 1


def test_an_unlocked_release_resolves_its_dependencies_and_a_commit_is_refused():
    env = get_environment("v0.33.0-nvidia")
    with pytest.raises(UsageError, match="names no Python version .* PYTHON_VERSION=3.12"):
        wheelhouse.pip_download(env, "/tmp/wh")
    command = wheelhouse.pip_download(env, "/tmp/wh", python="3.12")
    assert command[-1] == "vllm==0.33.0" and "--no-deps" not in command
    with pytest.raises(UsageError, match="pins a vLLM commit"):
        wheelhouse.requirements(get_environment("nightly-77154ca6-b200"))


def test_the_install_script_checks_joins_the_parts_and_makes_the_venv(tmp_path):
    """Two fake wheels, split into parts of 1 MiB; install.sh run for real with a `make` that records its call."""
    out = tmp_path / "wh"
    (out / "wheels").mkdir(parents=True)
    for name, size in (("vllm-0.32.0-cp38-abi3-manylinux_2_31_x86_64.whl", 1_500_000), ("triton-3.7.1-x.whl", 700_000)):
        (out / "wheels" / name).write_bytes(os.urandom(size))
    (out / "SHA256SUMS").write_text("".join(f"{wheelhouse.sha256(p)}  {p.name}\n" for p in sorted((out / "wheels").iterdir())))
    wheelhouse.write_install(out, get_environment("v0.32.0-h200"))
    parts = wheelhouse.split(out, 1)
    assert len(parts) == 3 and not (out / "wheels").exists() and all(p.stat().st_size <= 2**20 for p in parts)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_make = bin_dir / "make"
    fake_make.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/make-args\n")
    fake_make.chmod(fake_make.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(out / "install.sh")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "2 wheels checked" in result.stdout
    assert (tmp_path / "make-args").read_text().split() == ["venv", "ENV=v0.32.0-h200", f"WHEELS={out}/wheels"]
    # A damaged part is refused before anything is installed.
    (tmp_path / "make-args").unlink()
    import shutil

    shutil.rmtree(out / "wheels")
    parts[1].write_bytes(b"damaged")
    result = subprocess.run(["bash", str(out / "install.sh")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode != 0 and not (tmp_path / "make-args").exists()
