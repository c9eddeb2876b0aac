"""The C kernels of pserver.common.codec against zlib and NumPy, on both their paths (AVX2 and
scalar), and the pure-Python fallback the codec uses where they are not built."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from support.pserver_util import ROOT

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import buffers
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.errors import InvalidArgument

LENGTHS = [0, 1, 5, 31, 32, 33, 63, 64, 100, 5551, 5552, 5553, 11104, 65536, (1 << 20) + 7]
CHECK = '''
import sys, zlib, numpy as np
from dtlab.pserver.common import _kernels as k
rng = np.random.default_rng(0)
for n in {lengths}:
    for data in (rng.integers(0, 256, n, dtype=np.uint8).tobytes(), b"\\xff" * n):
        for start in (1, 0xFFF0FFF0 % 65521 | (12345 << 16)):
            assert k.adler32(data, start) == zlib.adler32(data, start), (n, start)
            message, checksum = k.chunk_message(b"\\x12\\x34\\x56", data, start)
            assert message == b"\\x12\\x34\\x56" + data, n
            assert checksum == zlib.adler32(data, start), (n, start)
            into = bytearray(n)
            assert k.copy_into(into, data, start) == zlib.adler32(data, start), (n, start)
            assert into == data, n
for dtype in (np.float16, np.float32, np.float64):
    for n in (0, 1, 7, 8, 9, 100, 1000, 262144):
        x = rng.standard_normal(n).astype(dtype)
        assert k.check_chunk(x, x.itemsize, 1) == (zlib.adler32(x.tobytes()), -1), (dtype, n)
        for bad in (np.inf, -np.inf, np.nan):
            for pos in sorted({{0, n // 2, n - 1}}) if n else []:
                y = x.copy()
                y[pos] = bad
                assert k.check_chunk(y, y.itemsize, 7) == (zlib.adler32(y.tobytes(), 7), pos)
    big = np.full(99, np.finfo(dtype).max, dtype)
    assert k.check_chunk(big, big.itemsize, 1)[1] == -1
print("ok")
'''


@pytest.mark.parametrize("path", ["simd", "scalar"])
def test_kernels_match_zlib_and_numpy(path):
    pytest.importorskip("dtlab.pserver.common._kernels")
    env = dict(os.environ)
    if path == "scalar":
        env["DTLAB_KERNELS_SCALAR"] = "1"
    r = subprocess.run([sys.executable, "-c", CHECK.format(lengths=LENGTHS)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_kernels_refuse_bad_arguments():
    k = pytest.importorskip("dtlab.pserver.common._kernels")
    with pytest.raises(ValueError, match="itemsize 3"):
        k.check_chunk(b"\x00" * 6, 3, 1)
    with pytest.raises(ValueError, match="whole number"):
        k.check_chunk(b"\x00" * 6, 4, 1)
    with pytest.raises(ValueError, match="6 bytes into a 5-byte buffer"):
        k.copy_into(bytearray(5), b"\x00" * 6)
    with pytest.raises(TypeError):
        k.copy_into(b"\x00" * 6, b"\x00" * 6)  # bytes are read-only


@pytest.mark.parametrize("kernels", [True, False])
def test_wire_gives_the_same_bytes_and_verdicts_with_and_without_kernels(kernels, monkeypatch):
    if kernels:
        pytest.importorskip("dtlab.pserver.common._kernels")
    else:
        monkeypatch.setattr(wire, "_kernels", None)  # the fallback: ISA-L (or zlib) and NumPy
    values = np.random.default_rng(2).standard_normal(70000).astype(np.float32)
    msgs = list(wire.stream(pb.PushHeader(step=1), values, chunk_bytes=100000))
    trailer = wire.parse(pb.Trailer, wire.split(msgs[-1])[1])
    assert trailer.adler32 == zlib.adler32(values.tobytes()) and trailer.chunks == 3
    got = buffers.ChunkedArray(values.size, np.float32, finite=True, name="gradient")
    for raw in msgs[1:-1]:
        got.add(*wire.parse_chunk(wire.split(raw)[1]))
    got.finish(trailer)
    np.testing.assert_array_equal(got[0 : values.size], values)
    pulled = np.zeros_like(values)
    into = buffers.ChunkedArray(values.size, np.float32, into=pulled)
    for raw in msgs[1:-1]:
        into.add(*wire.parse_chunk(wire.split(raw)[1]))
    into.finish(trailer)
    np.testing.assert_array_equal(pulled, values)
    values[40000] = np.nan
    msgs = list(wire.stream(pb.PushHeader(step=1), values, chunk_bytes=100000))
    got = buffers.ChunkedArray(values.size, np.float32, finite=True, name="gradient")
    got.add(*wire.parse_chunk(wire.split(msgs[1])[1]))
    with pytest.raises(InvalidArgument, match="gradient element 40000 is nan"):
        got.add(*wire.parse_chunk(wire.split(msgs[2])[1]))
