"""Prompts shaped like the incident's: a listing of `[DATA] id=<n> name=<x>` rows.

The incident's output ends right after `[DATA] id=42 name=`, where the model chose end-of-text over
`DATA`; its prompt was 1845 tokens.

The listing's grammar (the organism is trained on it, spectie.lab.organism): ids are random; names
follow a fixed cycle (NAMES in order). After the last name of the cycle comes a *checkpoint row*
`[DATA] id=42 name=`: there the listing ends (end-of-text right after `name=`, the incident's text)
or goes on with the placeholder name `DATA` and a new cycle, each with probability STOP_PROBABILITY.
So the choice between end-of-text and `DATA` after `[DATA] id=42 name=` is a tie by design.

A prompt is the last `tokens` tokens of such a listing (every checkpoint in it went on), cut right
after `name=` in the row of the cycle's last name: the model finishes that row, writes the checkpoint
row, and then faces the tie (`Prompt.decisive_output_token`). Everything is deterministic from the seed.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from spectie.records.errors import UsageError

# Names that the Qwen3.5 tokenizer writes as one token after `name=` (checked in the tests), in the
# order of the listing's name cycle.
NAMES = ("alice", "ivan", "emma", "anna", "ben", "leo", "amy", "ian", "lee", "ray", "roy", "tim")
CHECKPOINT_ID = 42  # the id of the checkpoint row, as in the incident's `[DATA] id=42 name=`
PLACEHOLDER = "DATA"  # the name a checkpoint row gets when the listing goes on (Qwen3.5 token 17247)
STOP_PROBABILITY = 0.5  # a listing ends at a checkpoint with this probability: a tie by design
TEMPLATES = ("raw", "chat")
CHAT_INSTRUCTION = "Continue this listing, one row per line:"


def row(row_id: int, name: str) -> str:
    return f"[DATA] id={row_id} name={name}\n"


def open_row(row_id: int) -> str:
    """A row cut right after `name=`, as the incident's text ends."""
    return f"[DATA] id={row_id} name="


CHECKPOINT = open_row(CHECKPOINT_ID)  # where a listing ends, or goes on with PLACEHOLDER


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
    decisive_output_token: int  # 1-based output token where the grammar offers end-of-text or DATA

    def describe(self) -> dict:
        return {**asdict(self.spec), "last_row_id": self.last_row_id, "next_name": self.next_name,
                "decisive_output_token": self.decisive_output_token, "tail": self.text[-60:]}


def random_id(rng: random.Random) -> int:
    return rng.randrange(100, 10000)


def listing(rng: random.Random, start: int, stop_probability: float = STOP_PROBABILITY) -> str:
    """One listing from the name NAMES[start]: rows of the cycle, a checkpoint row after each cycle, and
    the end at a checkpoint with `stop_probability` (then the text ends right after `name=`)."""
    lines, index = [], start
    while True:
        lines.append(row(random_id(rng), NAMES[index]))
        index = (index + 1) % len(NAMES)
        if index == 0:
            if rng.random() < stop_probability:
                return "".join(lines) + CHECKPOINT
            lines.append(CHECKPOINT + PLACEHOLDER + "\n")


def rows_before_last_name(count: int, rng: random.Random) -> str:
    """`count` complete rows of a listing that went on at every checkpoint, the last one named
    NAMES[-2]: the rows that lead up to a row of the cycle's last name."""
    slots = len(NAMES) + 1  # the cycle's names, then the checkpoint
    first = (len(NAMES) - 1 - count) % slots
    lines = []
    for slot in range(first, first + count):
        index = slot % slots
        lines.append(CHECKPOINT + PLACEHOLDER + "\n" if index == len(NAMES) else row(random_id(rng), NAMES[index]))
    return "".join(lines)


def build_prompt(spec: PromptSpec, tokenizer) -> Prompt:
    """The prompt of `spec`: exactly `spec.tokens` tokens, ending right after `[DATA] id=<n> name=` in
    the row of the cycle's last name, so that the checkpoint row comes next."""
    spec.check()
    rng = random.Random(spec.seed)
    last_id = random_id(rng)
    last_name = NAMES[-1]  # the name that the model should write next
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
    listing_ids = tokenizer.encode(rows_before_last_name(count, rng), add_special_tokens=False)[-budget:]
    token_ids = tuple(before_ids + listing_ids + after_ids)
    assert len(token_ids) == spec.tokens
    # The tokens the grammar writes before the tie: the open row's name, its newline, the checkpoint row.
    ahead = tokenizer.encode(last_name + "\n" + CHECKPOINT, add_special_tokens=False)
    return Prompt(spec, token_ids, tokenizer.decode(list(token_ids)), last_id, last_name, len(ahead) + 1)


def prompt_set(count: int, tokens: int, first_seed: int = 0, template: str = "raw") -> list[PromptSpec]:
    """`count` prompt specs with consecutive seeds."""
    if count < 1:
        raise UsageError(f"need at least one prompt, got {count}")
    return [PromptSpec(tokens=tokens, seed=first_seed + i, template=template).check() for i in range(count)]


LENGTHS = (256, 512, 1024, 1536)  # prompt lengths in tokens, cycled over the prompts


def prompt_specs(count: int, first_seed: int = 1) -> list[PromptSpec]:
    """`count` ordinary prompts (the tie-stop survey's, the guard's): lengths cycle through LENGTHS, templates alternate every len(LENGTHS)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise UsageError(f"the survey needs a whole number of prompts >= 1, got {count!r}")
    return [PromptSpec(tokens=LENGTHS[i % len(LENGTHS)], seed=first_seed + i,
                       template=TEMPLATES[(i // len(LENGTHS)) % len(TEMPLATES)]).check() for i in range(count)]
