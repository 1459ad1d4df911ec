"""An environment's own interpreter: .venvs/<env> with the vLLM its environment pins (`make venv ENV=<env>`).

One way in per kind of pin:
- a release (`vllm.version`): `python -m venv .venvs/<env>`, then `pip install vllm==<version>` from PyPI
  (the official wheel pulls its own CUDA build of torch);
- the same release offline (WHEELS=<dir>, for a host with no internet whose torch is preinstalled): a venv
  that sees the system's packages, then `pip install --no-index --no-deps <dir>/*.whl`;
- a main-branch commit (`vllm.commit`): vLLM publishes a wheel per commit at wheels.vllm.ai/<full hash>/.
  Given to pip with --extra-index-url, that index is merged with PyPI and pip takes the highest version,
  a PyPI release, not the commit. So the wheel is downloaded from the commit's index alone, then installed
  as a file (its dependencies from PyPI). The full hash comes from VLLM_COMMIT.

Whatever was installed is then checked against the environment (`checks.check_installed`): a venv holding another
vLLM would put its numbers in the wrong column of the book.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import sys
from pathlib import Path

from spectie.records.errors import UsageError

COMMIT_INDEX = "https://wheels.vllm.ai/{commit}/"  # one index per main-branch commit (the full hash)


def pinned_environments() -> list[str]:
    """The environments whose vLLM `make venv` installs: they pin a release or a commit (cpu has .venv)."""
    from spectie.records.environments import load_environments

    return [env_id for env_id, env in load_environments().items()
            if env_id != "cpu" and (env["vllm"].get("version") or env["vllm"].get("commit"))]


def check_pinned(env: dict) -> None:
    """A UsageError for an environment that has no vLLM for .venvs/ to hold."""
    env_id, vllm = env["id"], env["vllm"]
    others = f"environments that pin one: {', '.join(pinned_environments())}"
    if env_id == "cpu":
        raise UsageError(f"environment 'cpu' pins no vLLM for .venvs/: it uses the project's .venv, where "
                         f"`make setup` installs the CPU build of vLLM; {others}")
    if not vllm.get("version") and not vllm.get("commit"):
        raise UsageError(f"environment {env_id!r} pins no vLLM (neither a version nor a commit), so there is "
                         f"nothing to install; {others}")


def full_commit(env: dict, commit: str | None) -> str:
    """The full 40-character hash of the environment's commit, given as VLLM_COMMIT (`commit`), checked."""
    short = str(env["vllm"]["commit"]).lower()
    how = (f"find it with `git rev-parse {short}` in a clone of https://github.com/vllm-project/vllm, then "
           f"make venv ENV={env['id']} VLLM_COMMIT=<full hash>")
    if not commit:
        raise UsageError(f"environment {env['id']!r} pins vLLM commit {short}; its wheel's index "
                         f"({COMMIT_INDEX.format(commit='<full hash>')}) needs the full 40-character hash "
                         f"in VLLM_COMMIT: {how}")
    commit = commit.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not commit.startswith(short):
        raise UsageError(f"VLLM_COMMIT={commit!r} is not the full hash of commit {short} (40 hex characters "
                         f"starting with {short}): {how}")
    return commit


def install_commands(env: dict, python: Path, wheels: str | Path | None = None,
                     commit: str | None = None) -> list[list[str]]:
    """The commands, in order, that put the environment's vLLM into the venv of `python`
    (.venvs/<env>/bin/python). An argument with a `*` stands for the files it matches, expanded when
    run (see `expand`). `wheels`: a folder of wheels to install offline (a release only); `commit`: the
    full hash (VLLM_COMMIT) for an environment pinned to a commit. Nothing is run or fetched here."""
    check_pinned(env)
    folder = python.parent.parent
    pip = [str(python), "-m", "pip"]
    version, short = env["vllm"].get("version"), env["vllm"].get("commit")
    if short:
        if wheels:
            raise UsageError(f"environment {env['id']!r} pins a commit; WHEELS (a folder of wheels) is for "
                             "environments that pin a release")
        wheelhouse = folder / "wheelhouse"
        return [[sys.executable, "-m", "venv", str(folder)],
                [*pip, "download", "--no-deps", "--pre", "--index-url",
                 COMMIT_INDEX.format(commit=full_commit(env, commit)), "vllm", "-d", str(wheelhouse)],
                [*pip, "install", str(wheelhouse / "vllm-*.whl")]]
    if wheels:
        wheels = Path(wheels)
        if not glob.glob(str(wheels / f"vllm-{version}[-+]*.whl")):
            raise UsageError(f"environment {env['id']!r} pins vLLM {version}, but {wheels} holds no "
                             f"vllm-{version}-*.whl (scripts/offline_wheels.sh downloads the wheels)")
        return [[sys.executable, "-m", "venv", "--system-site-packages", str(folder)],
                [*pip, "install", "--no-index", "--no-deps", str(wheels / "*.whl")]]
    return [[sys.executable, "-m", "venv", str(folder)],
            [*pip, "install", f"vllm=={version}"]]


def expand(command: list[str]) -> list[str]:
    """`command` with each file pattern (an argument with a `*`) replaced by the files it matches."""
    expanded = []
    for argument in command:
        if "*" not in argument:
            expanded.append(argument)
            continue
        files = sorted(glob.glob(argument))
        if not files:
            raise UsageError(f"no file matches {argument}")
        expanded += files
    return expanded


def share_image_packages(python: Path) -> Path:
    """Let the venv of `python` see the packages this interpreter sees outside its own prefix (an offline
    GPU image's torch and CUDA libraries, which may live in another environment than the system Python's
    that --system-site-packages would add): a .pth file listing those folders, after the venv's own."""
    own = Path(sys.prefix).resolve()
    folders = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))
               and Path(p).is_dir() and own not in Path(p).resolve().parents]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pth = Path(site) / "spectie-image-packages.pth"
    pth.write_text("".join(f"{folder}\n" for folder in folders))
    return pth


def create_venv(environment: str, wheels: str | Path | None = None, commit: str | None = None,
                log=print) -> Path:
    """.venvs/<environment> with that environment's vLLM (for GPU hosts), checked once installed; returns
    its interpreter. `wheels`, `commit`: see install_commands."""
    from spectie.records.environments import get_environment
    from spectie.engines.checks import check_installed, engine_python, probe_vllm

    env = get_environment(environment)
    python = engine_python(environment)
    commands = install_commands(env, python, wheels, commit)
    folder = python.parent.parent
    shutil.rmtree(folder / "wheelhouse", ignore_errors=True)  # only the wheel downloaded now is installed
    log(f"installing vLLM {env['vllm'].get('version') or 'commit ' + str(env['vllm']['commit'])} into {folder}")
    for command in commands:
        log("+ " + " ".join(command))
        try:
            subprocess.run(expand(command), check=True)
        except subprocess.CalledProcessError as error:
            raise UsageError(f"`{' '.join(command)}` failed (exit status {error.returncode}); its output is "
                             "above") from None
    if wheels:
        share_image_packages(python)
    probe = probe_vllm(environment, python)
    check_installed(env, probe)
    log(f"vLLM {probe['vllm_version']} on {probe['platform']} (torch {probe['torch']}, CUDA {probe['cuda']}) "
        f"ready in {folder}")
    return python
