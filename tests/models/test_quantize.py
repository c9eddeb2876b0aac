"""Block quantization (models/quantize.py): every element within half its block's scale,
a block of zeros kept exactly, the wire layout read back as written."""

from __future__ import annotations

import numpy as np
import pytest

from dtlab.models import quantize


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantization_error_is_bounded_by_half_a_block_scale(bits):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal(1000) * np.repeat([1e-3, 1.0, 30.0, 0.0], 250)).astype(np.float32)
    z = quantize.quantize(x, bits)
    back = quantize.dequantize(z)
    bound = quantize.error_bound(x, bits)
    err = np.abs(back.astype(np.float64) - x)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-12)
    assert np.all(back[750:] == 0)  # a block of zeros stays zero
    assert err.max() > 0.25 * bound.max()  # the bound is near what rounding does
    buf = np.empty(quantize.payload_bytes(x.size, bits), np.uint8)
    quantize.pack(z, buf)
    assert np.array_equal(quantize.dequantize(quantize.unpack(buf, x.size, bits)), back)
    assert buf.size == 4 * 4 + (1000 if bits == 8 else 500)
