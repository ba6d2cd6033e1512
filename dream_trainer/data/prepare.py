"""Turn a text corpus into a token file (`dream_trainer.data.tokens`).

    python -m dream_trainer.data.prepare corpus.txt corpus.tokens                  # bytes
    python -m dream_trainer.data.prepare corpus.txt corpus.tokens --tokenizer tokenizer.json

Documents are separated by blank lines (``--split lines``: one per line). The default
tokenizer is byte-level: a document's UTF-8 bytes are its tokens (ids 0-255, vocabulary 256).
``--tokenizer PATH`` loads a Hugging Face ``tokenizer.json`` from a local file with the
``tokenizers`` package (nothing is downloaded); the token dtype is ``uint16`` when the
vocabulary fits, else ``uint32``. An end-of-document id (``--eos``) can be appended to each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from dream_trainer.data.tokens import TokenFile, write_tokens

__all__ = ["documents", "load_tokenizer", "main", "prepare"]


def documents(text: str, split: str = "paragraphs") -> Iterator[str]:
    """The non-empty documents of `text`: separated by blank lines, or one per line."""
    if split not in ("paragraphs", "lines"):
        raise ValueError(f"split={split!r}: use 'paragraphs' or 'lines'")
    parts = text.split("\n\n") if split == "paragraphs" else text.splitlines()
    return (part.strip("\n") for part in parts if part.strip())


def load_tokenizer(spec: str) -> tuple[Callable[[str], list[int]], int]:
    """``(encode, vocabulary size)`` for ``"bytes"`` or a local ``tokenizer.json``."""
    if spec == "bytes":
        return (lambda doc: list(doc.encode("utf-8"))), 256
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--tokenizer {spec!r}: use 'bytes' or the path of a local tokenizer.json (no such file)")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(f"--tokenizer {spec}: reading a tokenizer.json needs the tokenizers package "
                          "(pip install tokenizers), or use --tokenizer bytes") from exc
    tokenizer = Tokenizer.from_file(str(path))
    return (lambda doc: tokenizer.encode(doc).ids), tokenizer.get_vocab_size()


def prepare(source: str | Path, output: str | Path, tokenizer: str = "bytes", split: str = "paragraphs",
            eos: int | None = None) -> TokenFile:
    """Tokenize the text file `source` into the token file `output`; returns it, opened."""
    encode, vocab = load_tokenizer(tokenizer)
    if eos is not None and not 0 <= eos < 2**32:
        raise ValueError(f"--eos {eos}: a token id is between 0 and 2**32 - 1")
    dtype = "uint16" if max(vocab, (eos or 0) + 1) <= 2**16 else "uint32"
    text = Path(source).read_text(encoding="utf-8")
    docs = (np.asarray(encode(doc) + ([eos] if eos is not None else []), dtype=np.int64)
            for doc in documents(text, split))
    return TokenFile(write_tokens(output, docs, dtype=dtype), dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dream_trainer.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a UTF-8 text file")
    p.add_argument("output", help="the token file to write")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or a local tokenizer.json")
    p.add_argument("--split", choices=["paragraphs", "lines"], default="paragraphs")
    p.add_argument("--eos", type=int, default=None, help="an id appended to every document")
    args = p.parse_args(argv)
    try:
        tokens = prepare(args.source, args.output, args.tokenizer, args.split, args.eos)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{tokens.path}: {tokens.n_tokens} tokens ({tokens.dtype.name}) in {tokens.n_docs} documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
