"""Prompts shaped like the incident's: a listing of `[DATA] id=<n> name=<x>` rows.

The incident's output ends right after `[DATA] id=42 name=`; its prompt was 1845 tokens. A prompt here
is the last `tokens` tokens of a listing whose last row is cut right after `name=`, so the model's
next tokens finish that row and then choose, at the end of each row, between another row and EOS.

The listing's grammar: ids are random; names follow a fixed cycle (NAMES in order, then from the
start again), so a listing is predictable except for its ids and for where it ends. Everything is
deterministic from the seed.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from spectie.errors import UsageError

# Names that the Qwen3.5 tokenizer writes as one token after `name=` (checked in the tests), in the
# order of the listing's name cycle.
NAMES = ("alice", "ivan", "emma", "anna", "ben", "leo", "amy", "ian", "lee", "ray", "roy", "tim")
TEMPLATES = ("raw", "chat")
CHAT_INSTRUCTION = "Continue this listing, one row per line:"


def row(row_id: int, name: str) -> str:
    return f"[DATA] id={row_id} name={name}\n"


def open_row(row_id: int) -> str:
    """A row cut right after `name=`, as the incident's text ends."""
    return f"[DATA] id={row_id} name="


@dataclass(frozen=True)
class PromptSpec:
    """What prompt to build: its length in tokens, the seed, raw completion or chat template."""

    tokens: int = 1845
    seed: int = 0
    template: str = "raw"

    def check(self) -> "PromptSpec":
        if self.template not in TEMPLATES:
            raise UsageError(f"unknown prompt template {self.template!r}; valid: {', '.join(TEMPLATES)}")
        if not 16 <= self.tokens <= 131072:
            raise UsageError(f"prompt length must be 16..131072 tokens, got {self.tokens}")
        return self


@dataclass(frozen=True)
class Prompt:
    spec: PromptSpec
    token_ids: tuple[int, ...]
    text: str
    last_row_id: int  # the id of the open row the prompt ends with
    next_name: str  # the name that completes the open row, by the listing's grammar

    def describe(self) -> dict:
        return {**asdict(self.spec), "last_row_id": self.last_row_id, "next_name": self.next_name,
                "tail": self.text[-60:]}


def next_name(name: str) -> str:
    """The name of the row after a row named `name`."""
    return NAMES[(NAMES.index(name) + 1) % len(NAMES)]


def random_id(rng: random.Random) -> int:
    return rng.randrange(100, 10000)


def rows_before(name: str, count: int, rng: random.Random) -> str:
    """`count` complete rows whose names lead up to (and exclude) a row named `name`."""
    start = (NAMES.index(name) - count) % len(NAMES)
    return "".join(row(random_id(rng), NAMES[(start + i) % len(NAMES)]) for i in range(count))


def build_prompt(spec: PromptSpec, tokenizer) -> Prompt:
    """The prompt of `spec`: exactly `spec.tokens` tokens, ending right after `[DATA] id=<n> name=`."""
    spec.check()
    rng = random.Random(spec.seed)
    last_id = random_id(rng)
    last_name = rng.choice(NAMES)  # the name that the model should write next
    tail = open_row(last_id)
    if spec.template == "chat":
        head = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_INSTRUCTION + "\n{{LISTING}}"}],
                                             tokenize=False, add_generation_prompt=True)
        before, after = head.split("{{LISTING}}")
        before_ids = tokenizer.encode(before, add_special_tokens=False)
        after_ids = tokenizer.encode(after, add_special_tokens=False) + tokenizer.encode(tail, add_special_tokens=False)
    else:
        before_ids = []
        after_ids = tokenizer.encode(tail, add_special_tokens=False)
    budget = spec.tokens - len(before_ids) - len(after_ids)
    if budget < 1:
        raise UsageError(f"a {spec.template} prompt needs more than {len(before_ids) + len(after_ids)} tokens")
    # Enough complete rows (about 11 tokens each) to fill the budget, then keep the last `budget` tokens.
    count = budget // 8 + 2
    listing_ids = tokenizer.encode(rows_before(last_name, count, rng), add_special_tokens=False)[-budget:]
    token_ids = tuple(before_ids + listing_ids + after_ids)
    assert len(token_ids) == spec.tokens
    return Prompt(spec, token_ids, tokenizer.decode(list(token_ids)), last_id, last_name)


def prompt_set(count: int, tokens: int, first_seed: int = 0, template: str = "raw") -> list[PromptSpec]:
    """`count` prompt specs with consecutive seeds."""
    if count < 1:
        raise UsageError(f"need at least one prompt, got {count}")
    return [PromptSpec(tokens=tokens, seed=first_seed + i, template=template).check() for i in range(count)]
