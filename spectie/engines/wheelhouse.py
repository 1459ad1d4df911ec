"""A wheelhouse for an air-gapped GPU host: an environment's wheels, their checksums and an install script.

`make wheelhouse ENV=<environment> OUT=<dir> [PART_MIB=<n>] [PYTHON_VERSION=3.12]`, on a machine that reaches PyPI, writes

    OUT/wheels/*.whl   the wheels of the environment's vLLM for the GPU host's Python and platform
    OUT/SHA256SUMS     one line per wheel
    OUT/install.sh     run on the GPU host from the project's checkout: checks the wheels, then
                       `make venv ENV=<environment> WHEELS=OUT/wheels` (no network)

With PART_MIB, the wheels travel as OUT/parts/wheelhouse.tar.part-NNN (each at most PART_MIB MiB) with
OUT/parts/SHA256SUMS, for copies limited in size; install.sh checks and joins them first.

An environment whose file names a lock (`wheelhouse: environments/wheels/<file>.txt`) gets exactly the versions
of that lock, without their dependencies: what its records ran with, beside the libraries its host image had. Any
other release environment gets `vllm==<version>` and every dependency pip resolves for the GPU host.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.lab.organism import file_sha256 as sha256

DEFAULT_GLIBC = (2, 28)  # manylinux_2_28: what vLLM's and torch's Linux wheels need at least


def target(env: dict, python: str | None = None) -> tuple[str, tuple[int, int]]:
    """The GPU host's Python (major.minor) and glibc, from the environment's file (`software`), else `python`."""
    software = env.get("software") or {}
    if python is not None and not re.fullmatch(r"\d+\.\d+", python):
        raise UsageError(f"--python must be the GPU host's Python as major.minor (e.g. 3.12), got {python!r}")
    version = python or software.get("python")
    match = re.match(r"^(\d+)\.(\d+)", str(version or ""))
    if not match:
        raise UsageError(f"environment {env['id']!r} names no Python version (software.python): give the GPU "
                         "host's, e.g. PYTHON_VERSION=3.12")
    glibc = re.search(r"glibc (\d+)\.(\d+)", str(software.get("os") or ""))
    return f"{match[1]}.{match[2]}", (int(glibc[1]), int(glibc[2])) if glibc else DEFAULT_GLIBC


def requirements(env: dict) -> tuple[list[str], bool]:
    """What to download and whether with dependencies: a lock's pins (exact, no dependencies), else vllm==X."""
    from spectie.records.paths import project_root

    version = (env.get("vllm") or {}).get("version")
    if (env.get("vllm") or {}).get("package"):
        raise UsageError(f"environment {env['id']!r} runs {env['vllm']['package']} (installed by make setup), not the "
                         "CUDA release a wheelhouse carries to a GPU host")
    if (env.get("vllm") or {}).get("commit") or not version:
        raise UsageError(f"environment {env['id']!r} pins a vLLM commit, not a release: its wheel comes from "
                         "wheels.vllm.ai (make venv ENV=... VLLM_COMMIT=...), so the wheelhouse has no release to fetch")
    lock = env.get("wheelhouse")
    if not lock:
        return [f"vllm=={version}"], True
    path = project_root() / lock
    if not path.is_file():
        raise UsageError(f"environment {env['id']!r}: its lock {lock} does not exist")
    pins = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    pins = [p for p in pins if p]
    bad = [p for p in pins if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+_-]+", p)]
    if bad or f"vllm=={version}" not in pins:
        raise UsageError(f"{lock}: every line must pin one wheel (name==version), vllm=={version} among them"
                         + (f"; not a pin: {bad[0]!r}" if bad else ""))
    return pins, False


def pip_download(env: dict, folder: Path, python: str | None = None) -> list[str]:
    """The pip command that downloads the environment's wheels into `folder`."""
    version, glibc = target(env, python)
    tag = version.replace(".", "")
    pins, with_dependencies = requirements(env)
    platforms = ["linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
                 *(f"manylinux_2_{minor}_x86_64" for minor in range(5, glibc[1] + 1))]
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", version,
               "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
               *(f"--platform={p}" for p in platforms), "--dest", str(folder)]
    return command + ([] if with_dependencies else ["--no-deps"]) + pins


INSTALL = """#!/usr/bin/env bash
# Installs vLLM {vllm} for environment {env} from this wheelhouse, with no network: run it on the GPU host from
# the project's checkout (after `make setup`, or scripts/offline_setup.sh there).
#   bash <wheelhouse>/install.sh
set -euo pipefail
here=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
if [ -d "$here/parts" ]; then  # a wheelhouse copied in parts: check each part, then join them
  (cd "$here/parts" && sha256sum -c --quiet SHA256SUMS)
  mkdir -p "$here/wheels"
  cat "$here"/parts/wheelhouse.tar.part-* | tar -xf - -C "$here/wheels"
fi
(cd "$here/wheels" && sha256sum -c --quiet "$here/SHA256SUMS")
echo "install: $(ls "$here"/wheels/*.whl | wc -l) wheels checked"
make venv ENV={env} WHEELS="$here/wheels"
"""


def write_install(out: Path, env: dict) -> Path:
    path = out / "install.sh"
    path.write_text(INSTALL.format(vllm=env["vllm"]["version"], env=env["id"]))
    path.chmod(0o755)
    return path


def split(out: Path, part_mib: int) -> list[Path]:
    """OUT/wheels as one tar stream cut into parts of at most `part_mib` MiB, with their checksums; the wheels
    folder is removed (install.sh joins the parts again)."""
    import shutil

    if part_mib < 1:
        raise UsageError(f"PART_MIB must be a whole number of MiB >= 1, got {part_mib}")
    parts = out / "parts"
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    names = sorted(p.name for p in (out / "wheels").glob("*.whl"))
    tar = subprocess.Popen(["tar", "-cf", "-", *names], cwd=out / "wheels", stdout=subprocess.PIPE)
    subprocess.run(["split", "-b", str(part_mib * 2**20), "-a", "3", "-d", "-", str(parts / "wheelhouse.tar.part-")],
                   stdin=tar.stdout, check=True)
    tar.stdout.close()
    if tar.wait() != 0:
        raise RuntimeError("tar of the wheels failed")
    written = sorted(parts.glob("wheelhouse.tar.part-*"))
    (parts / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in written))
    shutil.rmtree(out / "wheels")
    return written


def build(environment: str, out: str | Path, part_mib: int | None = None, python: str | None = None,
          log=print) -> Path:
    """Download the environment's wheels into OUT/wheels, write OUT/SHA256SUMS and OUT/install.sh (and the parts)."""
    from spectie.records.environments import get_environment

    env = get_environment(environment)
    out = Path(out)
    wheels = out / "wheels"
    command = pip_download(env, wheels, python)  # every check before any download
    if part_mib is not None and part_mib < 1:
        raise UsageError(f"PART_MIB must be a whole number of MiB >= 1, got {part_mib}")
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"wheelhouse: {environment} (vLLM {env['vllm']['version']}) into {out}")
    if subprocess.run(command).returncode != 0:
        raise RuntimeError(f"pip download of {environment}'s wheels failed (its output above); what it fetched "
                           f"before failing is left in {wheels}, with no SHA256SUMS or install.sh")
    pins, with_dependencies = requirements(env)
    files = sorted(wheels.glob("*.whl"))
    if not with_dependencies:  # exactly the lock's wheels (an earlier download into OUT may have left others)
        norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()  # noqa: E731
        wanted = {(norm(p.split("==")[0]), p.split("==")[1]) for p in pins}
        files = [f for f in files if (norm(f.name.split("-")[0]), f.name.split("-")[1]) in wanted]
        if len(files) != len(pins):
            raise UsageError(f"{env['wheelhouse']}: {len(pins)} pins but {len(files)} matching wheels downloaded")
    (out / "SHA256SUMS").write_text("".join(f"{sha256(f)}  {f.name}\n" for f in files))
    write_install(out, env)
    size = sum(f.stat().st_size for f in files) / 2**20
    log(f"wheelhouse: {len(files)} wheels, {size:.1f} MiB; SHA256SUMS and install.sh written")
    if part_mib:
        parts = split(out, part_mib)
        log(f"wheelhouse: {len(parts)} parts of at most {part_mib} MiB in {out / 'parts'}")
    log(f"on the GPU host, from the project's checkout: bash {out}/install.sh")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectie.engines.wheelhouse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("environment")
    parser.add_argument("out")
    parser.add_argument("--part-mib", type=int)
    parser.add_argument("--python", help="the GPU host's Python (major.minor) when the environment names none")
    args = parser.parse_args(argv)
    try:
        build(args.environment, args.out, args.part_mib, args.python)
    except (UsageError, RuntimeError) as exc:  # bad input (exit 2), or pip's download failed (exit 1)
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
