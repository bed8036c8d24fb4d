"""A deterministic character corpus for the example, plus a char tokenizer.

The text is produced by a small hand-written grammar of English-like sentences
from a fixed seed, so nothing is downloaded and every checkout trains on the
same bytes. It has enough structure (recurring words, punctuation, paragraph
shape) that a tiny model's loss drops within a few dozen steps.
"""
from __future__ import annotations

import random

import torch

_WORDS = {
    "adj": "old quiet bright small tired clever patient heavy narrow golden silver muddy".split(),
    "person": "miller baker sailor weaver farmer teacher painter fisher gardener carpenter".split(),
    "thing": "basket lantern letter ladder bucket kettle rope map wagon clock".split(),
    "place": "market harbor mill bridge orchard village square station valley river".split(),
    "verb": "carried mended painted found lost sold counted cleaned lifted opened".split(),
    "walk": "walked ran hurried wandered climbed drove".split(),
    "time": "at dawn|before noon|after supper|in the rain|on sunday|late at night|in early spring".split("|"),
    "feel": "glad worried calm curious proud sleepy".split(),
    "said": "said|whispered|asked|called out|answered".split("|"),
}

_TEMPLATES = [
    "the {adj} {person} {verb} a {thing} {time}.",
    "the {person} {walk} to the {place} {time}.",
    "a {adj} {thing} stood near the {place}, and the {person} felt {feel}.",
    "{time}, the {person} {verb} the {adj} {thing} by the {place}.",
    '"where is my {thing}?" {said} the {person}.',
    "nobody at the {place} knew why the {person} was so {feel}.",
    "the {person} and the {person} {walk} past the {adj} {place}.",
    '"the {thing} is {adj} today," {said} the {adj} {person}.',
]


def _sentence(rng: random.Random) -> str:
    template = rng.choice(_TEMPLATES)
    text = template.format_map(_Picker(rng))
    first = 1 if text.startswith('"') else 0  # capitalize the first letter, after an opening quote
    return text[:first] + text[first].upper() + text[first + 1 :]


class _Picker(dict):
    """format_map helper: every ``{slot}`` draws a fresh word from its list."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def __missing__(self, key: str) -> str:
        return self.rng.choice(_WORDS[key])


def generate_corpus(n_chars: int = 300_000, seed: int = 1234) -> str:
    """About ``n_chars`` characters of paragraphs of 3-7 sentences; same seed, same text."""
    rng = random.Random(seed)
    paragraphs, total = [], 0
    while total < n_chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraphs.append(paragraph)
        total += len(paragraph) + 2
    return "\n\n".join(paragraphs)[:n_chars]


class CharTokenizer:
    """Maps each distinct character of a text to an id (sorted, so stable)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus(val_fraction: float = 0.1, **kwargs) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, train ids, validation ids) for the generated corpus."""
    text = generate_corpus(**kwargs)
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    split = int(len(ids) * (1 - val_fraction))
    return tok, ids[:split], ids[split:]


def get_batch(
    data: torch.Tensor, micro_batch: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: ``idx`` (micro_batch, seq_len) and ``targets`` shifted by one."""
    starts = torch.randint(len(data) - seq_len - 1, (micro_batch,), generator=generator)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
