"""Block quantization of a float vector to int8 or 4 bits, one scale per block, and back.

Absmax block quantization (Dettmers et al. 2022, "8-bit optimizers via block-wise
quantization"), as the outer gradients of Streaming DiLoCo travel in few bits (Douillard
et al. 2025) and as INTELLECT-1 and ZeRO++ send int8 with a scale per block:

    scale_b = max_{i in b} |x_i| / Q           Q = 127 (int8), 7 (4 bits)
    q_i     = rint(x_i / scale_b) in [-Q, Q]   (0 in a block of zeros: scale_b = 0)
    x'_i    = q_i * scale_b                    |x_i - x'_i| <= scale_b / 2

The bound is what `error_bound` returns per element; tests/models/test_quantize.py holds
every element to it. On the wire a payload is the float32 scales then the codes: int8 as
they are, 4 bits two to a byte (q + 8 in each nibble, the even element in the low one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtlab.models.backend import array_module

QMAX = {8: 127, 4: 7}  # the largest code of each width
BLOCK = 256  # elements per scale (one float32 per 256 values: 1/64 of int8's bytes)


@dataclass
class Quantized:
    """`size` values as codes (uint8: int8 bits, or two 4-bit codes a byte) and scales."""

    codes: object  # (code_bytes(size, bits),) uint8
    scales: object  # (blocks(size),) float32
    size: int
    bits: int


def blocks(size: int, block: int = BLOCK) -> int:
    return -(-size // block)


def code_bytes(size: int, bits: int) -> int:
    return size if bits == 8 else -(-size // 2)


def payload_bytes(size: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of one quantized vector on the wire: its scales, then its codes."""
    return 4 * blocks(size, block) + code_bytes(size, bits)


def _check_bits(bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization to {bits} bits: only 8 or 4")


def quantize(x, bits: int, block: int = BLOCK) -> Quantized:
    """x: (n,) float -> its codes and float32 scales (module docstring)."""
    _check_bits(bits)
    xp = array_module(x)
    n, nb, Q = x.size, blocks(x.size, block), QMAX[bits]
    padded = xp.zeros(nb * block, np.float32)  # (nb * block,)
    padded[:n] = x
    rows = padded.reshape(nb, block)  # (nb, block)
    scales = xp.abs(rows).max(axis=1) / np.float32(Q)  # (nb,) float32
    safe = xp.where(scales > 0, scales, np.float32(1))  # (nb,) a block of zeros stays 0
    q = xp.clip(xp.rint(rows / safe[:, None]), -Q, Q).astype(np.int8).reshape(-1)[:n]  # (n,)
    if bits == 8:
        return Quantized(q.view(np.uint8), scales, n, bits)
    nibbles = xp.zeros(2 * code_bytes(n, 4), np.uint8)  # (2 * bytes,) q + 8 in 1..15
    nibbles[:n] = (q + 8).astype(np.uint8)
    codes = nibbles[0::2] | (nibbles[1::2] << 4)  # (bytes,) even element in the low nibble
    return Quantized(codes, scales, n, bits)


def dequantize(z: Quantized, out=None, block: int = BLOCK):
    """The values z stands for, float32 (into `out`, shape (z.size,), if given)."""
    _check_bits(z.bits)
    xp = array_module(z.codes)
    if z.bits == 8:
        q = z.codes.view(np.int8)[: z.size]  # (n,)
    else:
        nibbles = xp.empty(2 * z.codes.size, np.uint8)  # (2 * bytes,)
        nibbles[0::2] = z.codes & 15
        nibbles[1::2] = z.codes >> 4
        q = nibbles[: z.size].astype(np.int8) - np.int8(8)  # (n,)
    per_element = xp.repeat(z.scales, block)[: z.size]  # (n,)
    if out is None:
        out = xp.empty(z.size, np.float32)
    return xp.multiply(q, per_element, out=out, dtype=np.float32)


def error_bound(x, bits: int, block: int = BLOCK):
    """(n,): half the scale of each element's block, the most rounding can move it."""
    z = quantize(x, bits, block)
    return array_module(x).repeat(z.scales, block)[: x.size] / 2


def pack(z: Quantized, out) -> None:
    """z onto the wire: `out` (payload_bytes,) uint8 holds the scales, then the codes."""
    s = z.scales.view(np.uint8)
    out[: s.size] = s
    out[s.size : s.size + z.codes.size] = z.codes


def unpack(buf, size: int, bits: int, block: int = BLOCK) -> Quantized:
    """The Quantized a payload `buf` (payload_bytes,) uint8 holds (views into it)."""
    nb = blocks(size, block)
    scales = buf[: 4 * nb].view(np.float32)  # (nb,)
    return Quantized(buf[4 * nb : 4 * nb + code_bytes(size, bits)], scales, size, bits)
