"""Byte-level text data for ``fullshard train``.

The default corpus is the Python standard library's own source (the ``*.py``
files next to ``os.py``): every machine that runs fullshard has it, it needs
no download, and at about 5 MB of real, varied text it is enough for a small
language model to show learning within minutes. ``--data`` points at a file
or a folder of files instead.

Batches are a pure function of (seed, step): every rank draws the same global
batch and takes its own rows, so a run resumed at another world size sees the
same data as an uninterrupted one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fullshard.cli.launch import UserError

EVAL_FRACTION = 0.05


def default_corpus() -> Path:
    return Path(os.__file__).parent


def corpus_files(path: Path) -> list[Path]:
    if not path.exists():
        raise UserError(f"data path {path} does not exist")
    if path.is_file():
        return [path]
    pattern = "*.py" if path == default_corpus() else "**/*"
    files = sorted(p for p in path.glob(pattern) if p.is_file() and not p.name.startswith("."))
    if not files:
        raise UserError(f"data folder {path} holds no files")
    return files


@dataclass
class Corpus:
    path: Path
    train: torch.Tensor  # uint8 bytes
    eval: torch.Tensor

    @classmethod
    def load(cls, path: Path, seq_len: int) -> Corpus:
        data = b"".join(f.read_bytes() for f in corpus_files(path))
        need = 2 * (seq_len + 1)
        if len(data) < need:
            raise UserError(f"data at {path} has {len(data)} bytes; sequences of {seq_len} need at least {need}")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        split = max(seq_len + 1, int(len(tokens) * (1 - EVAL_FRACTION)))
        split = min(split, len(tokens) - (seq_len + 1))
        return cls(path, tokens[:split], tokens[split:])

    def batch(self, split: str, seed: int, index: int, rows: int, seq_len: int) -> torch.Tensor:
        """``rows`` sequences of ``seq_len + 1`` bytes, the same for a given (split, seed, index) everywhere."""
        source = self.train if split == "train" else self.eval
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 2 + (split == "eval"))
        starts = torch.randint(0, len(source) - seq_len, (rows,), generator=gen)
        return torch.stack([source[s : s + seq_len + 1] for s in starts.tolist()]).long()
