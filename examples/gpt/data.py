"""Synthetic data for the tiny GPT demo (no downloads).

`prepare_token_files` writes the generated corpus as text and turns it into byte-level token
files with ``dream_trainer.data.prepare`` (what ``python -m dream_trainer.data.prepare`` does
for any corpus); the demo trains from those. The corpus comes from a small probabilistic grammar with learnable structure:
subject/verb number agreement ("the dog sees" / "the dogs see"), determiners
and adjectives, optional prepositional phrases, capitalization, punctuation,
and small arithmetic facts ("three plus four is seven.").
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

_DETS_SG = ["the", "a", "this", "that", "every", "one"]
_DETS_PL = ["the", "these", "those", "some", "many", "two", "three"]
_ADJS = ["old", "big", "small", "red", "happy", "quiet", "green", "tall", "young", "lazy"]
_NOUNS = [  # (singular, plural)
    ("dog", "dogs"), ("cat", "cats"), ("bird", "birds"), ("child", "children"),
    ("man", "men"), ("woman", "women"), ("ball", "balls"), ("tree", "trees"),
    ("house", "houses"), ("fox", "foxes"), ("teacher", "teachers"), ("box", "boxes"),
]
_VERBS = [  # (3rd person singular, plural)
    ("sees", "see"), ("likes", "like"), ("finds", "find"), ("chases", "chase"),
    ("watches", "watch"), ("has", "have"), ("wants", "want"), ("carries", "carry"),
]
_INTRANS = [("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait")]
_PREPS = ["near", "under", "behind", "with", "in", "on"]
_NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
    "seventeen", "eighteen",
]


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """Return (phrase, is_plural)."""
    plural = rng.random() < 0.4
    det = rng.choice(_DETS_PL if plural else _DETS_SG)
    noun = rng.choice(_NOUNS)[1 if plural else 0]
    words = [det]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJS))
    words.append(noun)
    return " ".join(words), plural


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.15:
        a, b = rng.randrange(10), rng.randrange(10)
        if rng.random() < 0.7:
            s = f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}"
        else:
            a, b = max(a, b), min(a, b)
            s = f"{_NUMBERS[a]} minus {_NUMBERS[b]} is {_NUMBERS[a - b]}"
        end = "."
    else:
        subj, plural = _noun_phrase(rng)
        if r < 0.3:
            verb = rng.choice(_INTRANS)[1 if plural else 0]
            s = f"{subj} {verb}"
        else:
            verb = rng.choice(_VERBS)[1 if plural else 0]
            obj, _ = _noun_phrase(rng)
            s = f"{subj} {verb} {obj}"
        if rng.random() < 0.35:
            pp, _ = _noun_phrase(rng)
            s = f"{s} {rng.choice(_PREPS)} {pp}"
        end = "!" if rng.random() < 0.1 else "."
    return s[0].upper() + s[1:] + end


def generate_corpus(n_chars: int, seed: int = 0) -> str:
    """Deterministically generate at least ``n_chars`` characters of text
    (truncated to exactly ``n_chars``). Uses only ``random.Random(seed)``."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < n_chars:
        sep = "\n" if rng.random() < 0.2 else " "
        piece = _sentence(rng) + sep
        parts.append(piece)
        total += len(piece)
    return "".join(parts)[:n_chars]


class CharTokenizer:
    """Character-level tokenizer over the sorted unique characters of a text."""

    def __init__(self, text: str) -> None:
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class TokenWindows(Dataset):
    """``(x, y)`` windows over a 1-D token tensor: ``x = data[i:i+T]``,
    ``y = data[i+1:i+T+1]`` for ``i = 0, stride, 2*stride, ...``."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if data.dim() != 1:
            raise ValueError("data must be a 1-D tensor of token ids")
        self.data = data.long()
        self.block_size = block_size
        self.stride = block_size if stride is None else stride
        if self.stride <= 0:
            raise ValueError("stride must be positive")
        n = len(self.data) - block_size - 1  # last valid start index
        self._len = 0 if n < 0 else n // self.stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if idx < 0:
            idx += self._len
        if not 0 <= idx < self._len:
            raise IndexError(idx)
        i = idx * self.stride
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def make_datasets(
    n_chars: int = 400_000, block_size: int = 64, val_fraction: float = 0.1, seed: int = 0
) -> tuple[TokenWindows, TokenWindows, CharTokenizer]:
    """Generate a corpus, tokenize it, and split the token stream into
    contiguous train (first ``1 - val_fraction``) and val (rest) datasets."""
    text = generate_corpus(n_chars, seed=seed)
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text), dtype=torch.long)
    n_val = int(len(data) * val_fraction)
    train = TokenWindows(data[: len(data) - n_val], block_size)
    val = TokenWindows(data[len(data) - n_val :], block_size)
    return train, val, tok


class ByteTokenizer:
    """Byte-level: a text's UTF-8 bytes are its tokens (the default of ``dream_trainer.data.prepare``)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def prepare_token_files(directory: str | Path, n_chars: int = 400_000, val_fraction: float = 0.1,
                        seed: int = 0, split: str = "paragraphs") -> tuple[Path, Path]:
    """``(train, validation)`` token files of the generated corpus in `directory` (made
    once; every rank may call it at once: each file is written under a name of its own
    process and renamed). The first ``1 - val_fraction`` of the text trains, the rest
    validates. `split`: ``"paragraphs"``, the corpus is one document (it has no blank
    lines); ``"lines"``, each line is a document (the newlines are not tokens then)."""
    from dream_trainer.data.prepare import prepare

    directory = Path(directory) / (f"corpus-{n_chars}-{seed}" + ("" if split == "paragraphs" else f"-{split}"))
    paths = directory / "train.tokens", directory / "val.tokens"
    if all(path.is_file() for path in paths):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    text = generate_corpus(n_chars, seed=seed)
    cut = len(text) - int(len(text) * val_fraction)
    for part, path in zip((text[:cut], text[cut:]), paths):
        source = path.with_suffix(f".{os.getpid()}.txt")
        source.write_text(part, encoding="utf-8")
        prepare(source, path, split=split)  # bytes; paragraphs: one document (the corpus has no blank lines)
        source.unlink()
    return paths
