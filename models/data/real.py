"""Real data, with no known loss floor.

    digits  scikit-learn's bundled handwritten digits (Alpaydin & Kaynak 1998):
            1797 8x8 images, pixels 0..16 scaled to [0, 1], 10 classes
    text    the bytes of a local file as tokens (vocab 256), cut into
            next-token windows like the Markov stream

    python -m dtlab.models.run.train --model mlp --data digits
    python -m dtlab.models.run.train --model transformer --data text --path corpus.txt
"""

from __future__ import annotations

import numpy as np

from dtlab.models.config import ConfigError
from dtlab.models.data.dataset import ArrayDataset, TokenWindows


def load_digits() -> ArrayDataset:
    """x (1797, 64) float32 in [0, 1], y (1797,) int64 in 0..9."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as e:
        raise ConfigError("--data digits needs scikit-learn: pip install dtlab[data]") from e
    bunch = sklearn_digits()
    x = bunch.data.astype(np.float32) / 16.0  # (1797, 64), pixel counts 0..16
    return ArrayDataset("digits", x, bunch.target.astype(np.int64), 10, None)


def load_text(path: str, seq_len: int) -> TokenWindows:
    """The bytes of `path` as int64 tokens in windows of `seq_len`; ConfigError naming
    --path if the file cannot be read or holds fewer than seq_len + 1 bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"--path {path}: cannot read it ({e.strerror})") from e
    if len(raw) < seq_len + 1:
        raise ConfigError(f"--path {path}: {len(raw)} bytes is too short for one window "
                          f"of --seq-len {seq_len} (needs {seq_len + 1})")
    stream = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)  # (N,)
    return TokenWindows("text", stream, seq_len, 256, None, {"path": path})
