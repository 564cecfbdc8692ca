"""Real text for the training-step benchmark, shipped with Python: no download, no tokenizer library.

The corpus is the source of the Python standard library (``*.py`` under ``sysconfig``'s
``stdlib`` path, test suites and vendored packages left out), read as bytes: a byte-level
tokenizer with a vocabulary of 256. Files are taken in sorted path order, so the corpus is the
same on every machine with the same Python version (its SHA-256 is reported so that runs can be
compared); they are read in a fixed pseudo-random order (the hash of each path) until
``max_bytes``. Every ``HOLDOUT_EVERY``-th file of that order goes to the validation split: whole
files are held out, so no validation sequence overlaps a training one.

Batches are drawn from seeded generators, ahead of time, as start offsets into the corpus: every
variant of a benchmark run trains on exactly the same sequences in the same order, and fetching
a micro-batch on the GPU is one gather (no host sync, no host-to-device copy in the step).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

__all__ = ["VOCAB_SIZE", "HOLDOUT_EVERY", "TextCorpus", "stdlib_source_files", "load_corpus", "BatchSampler"]

VOCAB_SIZE = 256
HOLDOUT_EVERY = 20
# Folders of the stdlib that are not representative source (test suites, vendored code, demos).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3",
              "turtledemo", "ensurepip", "pydoc_data"}


@dataclass
class TextCorpus:
    train: torch.Tensor  # uint8 [n_train] on the CPU
    val: torch.Tensor  # uint8 [n_val]
    source: str  # where the bytes came from
    num_files: int
    sha256: str

    def describe(self) -> str:
        return (f"{self.source}: {self.num_files} files, {self.train.numel() / 1e6:.2f} MB train / "
                f"{self.val.numel() / 1e6:.2f} MB held out (every {HOLDOUT_EVERY}th file), "
                f"byte-level vocab {VOCAB_SIZE}, sha256 {self.sha256[:12]}")


def stdlib_source_files(root: Optional[str] = None) -> List[str]:
    """Sorted paths of the standard library's ``.py`` files (test suites and vendored code left out)."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def load_corpus(max_bytes: int = 16 << 20, root: Optional[str] = None) -> TextCorpus:
    """About ``max_bytes`` of the stdlib's source as a train/validation byte split."""
    if max_bytes < 4096:
        raise ValueError(f"max_bytes must be >= 4096, got {max_bytes}")
    root = root or sysconfig.get_paths()["stdlib"]
    files = stdlib_source_files(root)
    train_parts: List[bytes] = []
    val_parts: List[bytes] = []
    total = 0
    used = 0
    digest = hashlib.sha256()
    # A fixed pseudo-random order (by the hash of each relative path): a small corpus still mixes
    # modules of every kind instead of the alphabetically first ones.
    files.sort(key=lambda p: hashlib.sha256(os.path.relpath(p, root).encode()).hexdigest())
    for i, path in enumerate(files):
        if total >= max_bytes and val_parts:
            break
        with open(path, "rb") as f:
            text = f.read()
        if not text:
            continue
        text += b"\n"
        digest.update(os.path.relpath(path, root).encode() + b"\0" + text)
        (val_parts if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train_parts).append(text)
        total += len(text)
        used += 1
    train, val = b"".join(train_parts), b"".join(val_parts)
    if not val or not train:
        raise RuntimeError(f"too little text under {root} for a train/validation split ({used} files)")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()  # noqa: E731
    return TextCorpus(as_tensor(train), as_tensor(val), f"Python {sysconfig.get_python_version()} stdlib source",
                      used, digest.hexdigest())


class BatchSampler:
    """Deterministic next-byte-prediction micro-batches: ``(tokens, labels)``, each ``[mbs, seq]`` int64.

    ``train(step, micro)`` and ``val(i)`` index offsets drawn once from seeded CPU generators (the
    same on every device); the corpus and the offsets live on ``device``.
    """

    def __init__(self, corpus: TextCorpus, seq: int, mbs: int, steps: int, micro_batches: int, eval_batches: int,
                 device: torch.device, seed: int = 0):
        for name, value in (("seq", seq), ("mbs", mbs), ("steps", steps), ("micro_batches", micro_batches)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if corpus.train.numel() <= seq + 1 or corpus.val.numel() <= seq + 1:
            raise ValueError(f"seq={seq} is longer than the corpus splits")
        self.seq, self.mbs = seq, mbs
        self.num_steps, self.micro_batches, self.eval_batches = steps, micro_batches, eval_batches
        gen = torch.Generator().manual_seed(seed)
        train_offs = torch.randint(0, corpus.train.numel() - seq - 1, (steps, micro_batches, mbs), generator=gen)
        gen = torch.Generator().manual_seed(seed + 1)
        val_offs = torch.randint(0, corpus.val.numel() - seq - 1, (max(eval_batches, 1), mbs), generator=gen)
        self._train = corpus.train.to(device)
        self._val = corpus.val.to(device)
        self._train_offs = train_offs.to(device)
        self._val_offs = val_offs.to(device)
        self._window = torch.arange(seq + 1, device=device)

    def _gather(self, text: torch.Tensor, offs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        window = text[offs[:, None] + self._window].long()
        return window[:, :-1], window[:, 1:]

    def train(self, step: int, micro: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} outside the {self.num_steps} steps drawn")
        return self._gather(self._train, self._train_offs[step, micro])

    def val(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._gather(self._val, self._val_offs[i])
