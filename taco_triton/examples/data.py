"""Real text every machine has: the Python standard library's own source, as bytes.

Byte-level tokens (vocabulary 256) need no tokenizer download. The file list is sorted and the
split deterministic, so every rank and every run sees the same data.
"""
from __future__ import annotations

import os
import sysconfig

import torch


def stdlib_bytes(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Up to `max_bytes` of the standard library's .py sources, concatenated (uint8)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()


class TextBatches:
    """Train/validation batches of byte sequences; validation is the last `val_fraction`."""

    def __init__(self, data: torch.Tensor, seq_len: int, val_fraction: float = 0.1):
        split = int(len(data) * (1 - val_fraction))
        self.train, self.val, self.seq_len = data[:split].long(), data[split:].long(), seq_len

    def batch(self, split: str, batch_size: int, generator: torch.Generator):
        src = self.train if split == "train" else self.val
        starts = torch.randint(0, len(src) - self.seq_len - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        seq = src[idx]
        return seq[:, :-1], seq[:, 1:]
