"""The Dataset protocol and the two in-memory shapes every source takes.

    classification  x (B, d_in) float32, y (B,) int64          ArrayDataset
    language        x (B, T) int64, y (B, T) int64 next tokens  TokenWindows

A language sample is a window of one token stream s:

    x_i = s[i T : i T + T],   y_i = s[i T + 1 : i T + T + 1],   n = (len(s) - 1) // T

so consecutive windows share one token (y_i's last is x_{i+1}'s first) and
every stream token but the first is a target exactly once.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Dataset(Protocol):
    """n examples, batched by index on the host; `floor` is the known loss floor
    in nats per prediction (None for real data)."""

    n: int
    floor: float | None

    def batch(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def describe(self) -> dict: ...


def check_indices(idx: np.ndarray, n: int) -> np.ndarray:
    """`idx` as an int64 array, or IndexError if any index is outside [0, n)."""
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"example index out of range [0, {n}): {idx.min()}..{idx.max()}")
    return idx


class ArrayDataset:
    """Classification pairs held in memory: x (n, d_in) float32, y (n,) int64."""

    def __init__(self, source: str, x: np.ndarray, y: np.ndarray, n_classes: int,
                 floor: float | None, info: dict | None = None):
        if x.ndim != 2 or y.shape != (x.shape[0],):
            raise ValueError(f"expected x (n, d) and y (n,), got {x.shape} and {y.shape}")
        self.source, self.n_classes = source, n_classes
        self.x = np.ascontiguousarray(x, dtype=np.float32)  # (n, d_in)
        self.y = np.ascontiguousarray(y, dtype=np.int64)  # (n,)
        self.n, self.floor, self.info = len(self.y), floor, info or {}

    def batch(self, idx):
        idx = check_indices(idx, self.n)
        return self.x[idx], self.y[idx]  # (B, d_in), (B,)

    def describe(self) -> dict:
        return {"source": self.source, "n": self.n, "d_in": self.x.shape[1],
                "n_classes": self.n_classes, "floor": self.floor, **self.info}


class TokenWindows:
    """Next-token windows of length `seq_len` over an int64 token stream."""

    def __init__(self, source: str, stream: np.ndarray, seq_len: int, vocab: int,
                 floor: float | None, info: dict | None = None):
        if len(stream) < seq_len + 1:
            raise ValueError(f"a stream of {len(stream)} tokens has no window of {seq_len} + 1")
        self.source, self.seq_len, self.vocab = source, seq_len, vocab
        self.stream = np.ascontiguousarray(stream, dtype=np.int64)  # (N,)
        self.n = (len(self.stream) - 1) // seq_len
        self.floor, self.info = floor, info or {}
        self._offsets = np.arange(seq_len + 1)  # (T + 1,)

    def batch(self, idx):
        idx = check_indices(idx, self.n)
        w = self.stream[idx[:, None] * self.seq_len + self._offsets]  # (B, T + 1)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])  # (B, T) each

    def describe(self) -> dict:
        return {"source": self.source, "n": self.n, "seq_len": self.seq_len,
                "vocab": self.vocab, "n_tokens": len(self.stream), "floor": self.floor,
                **self.info}


def in_words(desc: dict) -> str:
    """A dataset's describe() dict as one line for people: what it is, its size, its floor."""
    if "seq_len" in desc:
        text = (f"{desc['source']}: {desc['n_tokens']:,} tokens, vocab {desc['vocab']}, "
                f"{desc['n']:,} windows of {desc['seq_len']}")
        if "order" in desc:
            text += f", order-{desc['order']} source with {desc['support']} next tokens a context"
    else:
        text = (f"{desc['source']}: {desc['n']:,} examples, {desc['d_in']} features, "
                f"{desc['n_classes']} classes")
        if "label_noise" in desc:
            text += f", label noise {desc['label_noise']:g}"
    floor = desc.get("floor")
    return text + (f"; loss floor {floor:.4f} nats" if floor is not None else "; floor unknown")

