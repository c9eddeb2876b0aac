"""The wire contract: committed generated code is current, the hand codec is protobuf,
and the generated stub of any protobuf client talks to the server."""

from __future__ import annotations

import subprocess
import sys
import zlib

import grpc
import numpy as np
import pytest
from support.pserver_util import ROOT, connect, initial_params, serve

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.protos import dtlab_ps_pb2_grpc as pb_grpc
from dtlab.pserver.common import buffers
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.errors import DataLoss, InvalidArgument
from dtlab.pserver.worker.shard_client import PROCESS_REGISTRATION as REG

GENERATED = ("dtlab_ps_pb2.py", "dtlab_ps_pb2_grpc.py", "dtlab_ps_pb2.pyi")


def test_committed_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos"), "--out", str(tmp_path)],
                   check=True, timeout=120)
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        assert fresh == (ROOT / "protos" / name).read_text(), (
            f"protos/{name} is stale: run scripts/gen_protos")


def test_chunk_codec_is_protobuf():
    data = np.arange(10, dtype=np.float32)
    raw, checksum = wire.chunk_message(7, memoryview(data).cast("B"))
    assert checksum == zlib.adler32(data.tobytes())
    msg = pb.PushRequest.FromString(raw)
    assert msg.WhichOneof("kind") == "chunk"
    assert msg.chunk.start == 7 and msg.chunk.data == data.tobytes()
    for cls in (pb.PushRequest, pb.PullReply):  # same field numbers on both streams
        chunk = pb.Chunk(start=123456789, data=b"\x01\x02\x03\x04")
        standard = cls(chunk=chunk).SerializeToString()
        field, body = wire.split(standard)
        start, payload = wire.parse_chunk(body)
        assert (field, start, bytes(payload)) == (wire.CHUNK, 123456789, b"\x01\x02\x03\x04")


@pytest.mark.parametrize("start", [0, 1, 127, 128, 1 << 14, 1 << 21, 1 << 35])
@pytest.mark.parametrize("nbytes", [0, 4, 100, (1 << 14) - 4, 1 << 20, (1 << 21) - 4, 1 << 21])
def test_chunk_data_starts_aligned_and_the_pad_is_ignored(start, nbytes):
    """The pad field puts the data a multiple of ALIGN bytes into every message, whatever
    the varint widths; protobuf's own parser and ours both read it as plain data."""
    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    raw = wire.chunk_message(start, memoryview(data))[0]
    assert (len(raw) - nbytes) % wire.ALIGN == 0
    chunk = pb.PullReply.FromString(raw).chunk
    assert (chunk.start, chunk.data) == (start, data)
    got_start, got = wire.parse_chunk(wire.split(raw)[1])
    assert (got_start, bytes(got)) == (start, data)


def received(msgs, n: int, **kw) -> buffers.ChunkedArray:
    got = buffers.ChunkedArray(n, np.float32, **kw)
    for raw in msgs:
        got.add(*wire.parse_chunk(wire.split(raw)[1]))
    return got


def test_stream_round_trip_checks_order_and_checksum():
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    msgs = list(wire.stream(pb.PushHeader(step=3), values, chunk_bytes=400))
    assert wire.split(msgs[0])[0] == wire.HEADER and wire.split(msgs[-1])[0] == wire.TRAILER
    trailer = wire.parse(pb.Trailer, wire.split(msgs[-1])[1])
    assert trailer.chunks == 10 and trailer.adler32 == zlib.adler32(values.tobytes())

    got = received(msgs[1:-1], values.size)
    got.finish(trailer)
    np.testing.assert_array_equal(got[90:910], values[90:910])
    out = np.zeros_like(values)
    received(msgs[1:-1], values.size, into=out).finish(trailer)  # a pull: copied, not kept
    np.testing.assert_array_equal(out, values)
    with pytest.raises(ValueError, match="copied its chunks"):
        received(msgs[1:-1], values.size, into=out)[0:5]
    with pytest.raises(ValueError, match="into: float64"):
        buffers.ChunkedArray(values.size, np.float32, into=out.astype(np.float64))
    flipped = list(msgs[1:-1])
    flipped[4] = flipped[4][:-1] + bytes([flipped[4][-1] ^ 1])
    with pytest.raises(DataLoss, match="adler32"):
        received(flipped, values.size).finish(trailer)
    with pytest.raises(DataLoss, match="chunks"):
        received(msgs[1:-1], values.size).finish(pb.Trailer(adler32=trailer.adler32, chunks=9))
    nan = values.copy()
    nan[567] = np.nan
    with pytest.raises(InvalidArgument, match="gradient element 567 is nan"):
        received(list(wire.stream(pb.PushHeader(), nan, 400))[1:-1], values.size, finite=True,
                 name="gradient")

    got = buffers.ChunkedArray(values.size, np.float32)
    with pytest.raises(InvalidArgument, match="expected 0"):
        got.add(*wire.parse_chunk(wire.split(msgs[2])[1]))  # a gap
    with pytest.raises(InvalidArgument, match="whole number"):
        got.add(0, memoryview(b"\x00" * 6))
    got = buffers.ChunkedArray(3, np.float32)
    with pytest.raises(InvalidArgument, match="runs past"):
        got.add(0, memoryview(values[:4].tobytes()))
    got.add(0, memoryview(values[:3].tobytes()))
    with pytest.raises(DataLoss, match="adler32"):
        got.finish(pb.Trailer(adler32=trailer.adler32, chunks=1))
    with pytest.raises(DataLoss, match="ended at element 0"):
        buffers.ChunkedArray(3, np.float32).finish(pb.Trailer(chunks=0))


def test_big_chunks_are_used_in_place_and_small_ones_coalesced():
    values = np.arange(3 * wire.KEEP_BYTES // 4 + 7, dtype=np.float32)
    msgs = list(wire.stream(pb.PushHeader(), values, chunk_bytes=wire.KEEP_BYTES))
    got = received(msgs[1:-1], values.size)
    got.finish(wire.parse(pb.Trailer, wire.split(msgs[-1])[1]))
    assert [p.size for p in got.pieces] == [wire.KEEP_BYTES // 4] * 3 + [7]
    assert all(not p.flags.owndata and p.flags.aligned for p in got.pieces[:3])  # in place
    q = wire.KEEP_BYTES // 4
    assert np.shares_memory(got[q + 5 : 2 * q - 5], got.pieces[1])  # a view inside a piece
    np.testing.assert_array_equal(got[q - 5 : 2 * q + 5], values[q - 5 : 2 * q + 5])  # gathered
    np.testing.assert_array_equal(got[0 : values.size], values)

    msgs = list(wire.stream(pb.PushHeader(), values, chunk_bytes=8))  # 2 elements a chunk
    got = received(msgs[1:-1], values.size)
    got.finish(wire.parse(pb.Trailer, wire.split(msgs[-1])[1]))
    assert len(got.pieces) == 1 and got.chunks == len(msgs) - 2  # one copied run
    np.testing.assert_array_equal(got[5 : values.size - 3], values[5:-3])


def test_snapshot_streams_match_the_plain_stream():
    values = np.arange(300, dtype=np.float32)
    snap = buffers.Snapshot(values, chunk_bytes=256)
    want = list(wire.stream(pb.PullHeader(), values, 256))
    assert list(snap.stream(pb.PullHeader())) == want
    assert list(snap.stream(pb.PullHeader())) == want  # a second reader, checksums cached


@pytest.mark.parametrize("raw, match", [
    (b"", "none of"),
    (b"\x0a\x05\x01", "runs past"),
    (b"\xff" * 11, "varint"),
    (b"\x0f", "wire type"),
    (b"\x08\x01", "not a message"),
    (wire.header_message(pb.PushHeader()) + wire.trailer_message(0, 0), "more than one"),
])
def test_malformed_messages_are_invalid_argument(raw, match):
    with pytest.raises(InvalidArgument, match=match):
        wire.split(raw)


def test_generated_stub_speaks_to_the_server():
    """A plain protobuf client (generated classes, no hand codec) can pull and push."""
    init = initial_params()
    with serve() as daemons:
        connect(f"127.0.0.1:{daemons[0].port}")  # registers worker 0
        with grpc.insecure_channel(f"127.0.0.1:{daemons[0].port}") as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            replies = list(stub.Pull(pb.PullRequest(registration=REG,
                                                    worker_id=0, shard=0), timeout=20))
            header = replies[0].header
            assert header.meta.dtype == pb.FLOAT32 and list(header.meta.shape) == [init.size]
            got = np.frombuffer(b"".join(r.chunk.data for r in replies[1:-1]), np.float32)
            np.testing.assert_array_equal(got, init.data)
            assert replies[-1].trailer.adler32 == zlib.adler32(init.data.tobytes())

            grad = np.ones(init.size, np.float32)
            meta = pb.TensorMeta(dtype=pb.FLOAT32, shape=[init.size], offset=0, version=0)
            reqs = [pb.PushRequest(header=pb.PushHeader(registration=REG,
                                                        worker_id=0, step=0, shard=0, meta=meta)),
                    pb.PushRequest(chunk=pb.Chunk(start=0, data=grad.tobytes())),
                    pb.PushRequest(trailer=pb.Trailer(adler32=zlib.adler32(grad.tobytes()),
                                                      chunks=1))]
            reply = stub.Push(iter(reqs), timeout=20)
            assert (reply.duplicate, reply.staleness, reply.version) == (False, 0, 1)

            # the same on one Session stream: a push (the header at version 1), then a pull
            reqs[0].header.step, reqs[0].header.meta.version = 1, 1
            session = [pb.SessionRequest(**{r.WhichOneof("kind"): getattr(r, r.WhichOneof("kind"))})
                       for r in reqs]
            session.append(pb.SessionRequest(pull=pb.PullRequest(registration=REG,
                                                                 worker_id=0, shard=0)))
            replies = list(stub.Session(iter(session), timeout=20))
            assert replies[0].pushed.version == 2
            assert replies[1].header.meta.version == 2 and replies[-1].HasField("trailer")
            got = np.frombuffer(b"".join(r.chunk.data for r in replies[2:-1]), np.float32)
            np.testing.assert_array_equal(got, init.data - 1 - 1)
        np.testing.assert_array_equal(daemons[0].store.params, init.data - 1 - 1)


@pytest.mark.parametrize("name", ["hand", "generated"])
def test_both_codecs_make_and_read_the_same_messages(name):
    """The hand codec and the generated classes agree on every chunk, either way."""
    codec, other = wire.CODECS[name], wire.CODECS["generated" if name == "hand" else "hand"]
    data = np.arange(1000, dtype=np.float32)
    raw, checksum = codec.chunk_message(5, memoryview(data).cast("B"), wire.ADLER_START)
    assert checksum == zlib.adler32(data.tobytes())
    for cls in (pb.PushRequest, pb.PullReply, pb.SessionRequest, pb.SessionReply):
        kind, (start, got) = other.read(cls, raw)
        assert (kind, start, bytes(got)) == ("chunk", 5, data.tobytes())
    header = pb.SessionRequest(pull=pb.PullRequest(registration=REG,
                                                   worker_id=3, shard=1)).SerializeToString()
    assert codec.read(pb.SessionRequest, header) == ("pull", pb.PullRequest(registration=REG,
                                                                            worker_id=3, shard=1))
    with pytest.raises(InvalidArgument, match="none of"):
        codec.read(pb.SessionRequest, b"")
