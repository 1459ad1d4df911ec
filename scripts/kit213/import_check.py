"""Import, one by one, every module that a vLLM 0.32.0 (or 0.31.0) engine run on Qwen3.5 (plain, ngram, ngram_gpu, mtp;
V1 and V2 model runners; language_model_only; gdn_prefill_backend="triton") goes through, and say what is
missing. Used on the H200 by the kit's gpu_install.sh (after the install, before any engine) and offline
on a CPU machine (there, modules that load CUDA kernels need libcuda.so.1: give a stub, see README).

Usage: PYTHONPATH=/tmp/site213 python3 import_check.py [--strict] [--as-h200] [--load-extensions]
Prints one line per module (ok / FAIL with the error), then the versions that matter. Exits 1 with
--strict when a module fails on a missing Python package (ModuleNotFoundError).
Offline only (a machine without a GPU):
  --as-h200          make vLLM's platform CUDA sm_90 before importing, so modules take their CUDA import
                     paths (also set CUDA_VISIBLE_DEVICES= so that vLLM keeps Triton without a driver)
  --load-extensions  dlopen every compiled extension of vllm and torchvision with RTLD_NOW: each symbol
                     must resolve against the torch 2.13 and CUDA libraries that the process loaded
  Both need libcuda.so.1: a stub that exports the cu* functions those extensions import will do
  (README: "Offline checks").
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback

MODULES = [
    "torch", "triton", "torchvision", "transformers",
    "transformers.models.qwen3_5", "transformers.models.qwen3_5.configuration_qwen3_5",
    "vllm", "vllm.engine.arg_utils", "vllm.platforms", "vllm.config.speculative",
    "vllm.entrypoints.llm", "vllm.sampling_params",
    "vllm.v1.engine.core", "vllm.v1.engine.core_client", "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.abstract", "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.models.qwen3_5", "vllm.model_executor.models.qwen3_5_mtp",
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.spec_decode.eagle", "vllm.v1.spec_decode.ngram_proposer", "vllm.v1.spec_decode.ngram_proposer_gpu",
    "vllm.v1.spec_decode.draft_model",
    "vllm.v1.sample.sampler", "vllm.v1.sample.rejection_sampler",
    "vllm.vllm_flash_attn", "vllm._custom_ops",
    "vllm.tokenizers", "vllm.transformers_utils.config", "vllm.transformers_utils.processor", "vllm.multimodal",
]

VERSIONS = ["torch", "triton", "torchvision", "transformers", "tokenizers", "huggingface_hub", "vllm", "numpy",
            "pydantic", "safetensors", "xgrammar", "openai", "fastapi"]


def pretend_h200() -> None:
    """Offline only: vLLM's current platform becomes CUDA, device capability 9.0 (an H200)."""
    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda
    from vllm.platforms.interface import DeviceCapability
    cls = cuda.NonNvmlCudaPlatform
    cls.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(9, 0))
    cls.get_device_name = classmethod(lambda c, device_id=0: "NVIDIA H200")
    platforms._current_platform = cls()
    print("platform forced to", type(platforms.current_platform).__name__, "sm_90 (offline check)")


def load_extensions() -> int:
    """dlopen every compiled extension of vllm and torchvision (RTLD_NOW); the number that failed."""
    import ctypes
    import glob

    import torch
    root = os.path.dirname(os.path.dirname(torch.__file__))
    failed = 0
    this_python = f".cpython-{sys.version_info.major}{sys.version_info.minor}-"
    for path in sorted(glob.glob(root + "/vllm/**/*.so", recursive=True) + glob.glob(root + "/torchvision/*.so")):
        if ".cpython-" in path and this_python not in path:
            print(f"skip  {path[len(root) + 1:]} (built for another Python; this Python never loads it)")
            continue
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            print(f"ok    {path[len(root) + 1:]} (loaded)")
        except OSError as error:
            failed += 1
            print(f"FAIL  {path[len(root) + 1:]}: {str(error)[:300]}")
    return failed


def main() -> int:
    strict = "--strict" in sys.argv
    if "--as-h200" in sys.argv:
        pretend_h200()
    failed_extensions = load_extensions() if "--load-extensions" in sys.argv else 0
    missing_packages, other = set(), []
    for name in MODULES:
        try:
            importlib.import_module(name)
            print(f"ok    {name}")
        except ModuleNotFoundError as error:
            missing_packages.add(error.name)
            print(f"FAIL  {name}: ModuleNotFoundError: {error}")
        except Exception as error:  # noqa: BLE001 - a report, not a program
            other.append(name)
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            print(f"FAIL  {name}: {last[:300]}")
    from importlib.metadata import PackageNotFoundError, version
    for dist in VERSIONS:
        try:
            print(f"version {dist} {version(dist)}")
        except PackageNotFoundError:
            print(f"version {dist} (not installed)")
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        for arg in ("language_model_only", "gdn_prefill_backend", "kv_cache_memory_bytes", "speculative_config"):
            print(f"engine arg {arg}: {'yes' if arg in fields else 'MISSING'}")
    except Exception as error:  # noqa: BLE001
        print(f"engine args: not readable ({error})")
    try:
        import torch
        print("torch from", os.path.dirname(torch.__file__), "cuda", torch.version.cuda,
              "nccl", ".".join(map(str, torch.cuda.nccl.version())),
              "cudnn compiled", torch._C._cudnn.getCompileVersion(), "runtime", torch._C._cudnn.getRuntimeVersion())
    except Exception as error:  # noqa: BLE001
        print(f"torch libraries: not readable ({error})")
    if missing_packages:
        print("MISSING PYTHON PACKAGES:", " ".join(sorted(missing_packages)))
    if other:
        print("OTHER FAILURES:", " ".join(other))
    if failed_extensions:
        print("EXTENSIONS THAT DO NOT LOAD:", failed_extensions)
    return 1 if strict and (missing_packages or failed_extensions) else 0


if __name__ == "__main__":
    sys.exit(main())
