"""A push that carries the next pull (PSClient.push_pull, WholePush.then_pull): the same
values, versions, staleness and deduplication as a separate push and pull, under ASP,
SSP and BSP with two workers, on every data path (one message, a streamed push with the
pull behind it, shared memory, per-call transport), from a client of the .proto's
generated classes too; a faulty then_pull is refused by name, and a push_pull retried
across a restart applies its push once. Over two shards with open sessions the pushes go
out from the calling thread, falling back to the retrying path when a session breaks."""

from __future__ import annotations

import queue
import threading
import time
import zlib

import grpc
import numpy as np
import pytest
from support.pserver_util import addresses, connect, initial_params, serve

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.protos import dtlab_ps_pb2_grpc as pb_grpc
from dtlab.pserver.common import codec as wire
from dtlab.pserver.worker.shard_client import PROCESS_REGISTRATION as REG
from dtlab.pserver.worker.shard_client import ShardClient

INIT = initial_params()
N = INIT.size
C = grpc.StatusCode
G = np.full(N, 2.0**-12, np.float32)  # lr 1: after v updates the parameters are INIT - v * G
PATHS = {  # name: connect() keyword arguments
    "whole": {"shm": False},
    "streamed": {"shm": False, "chunk_bytes": 64},
    "shm": {"shm": True},
    "calls": {"shm": False, "transport": "calls"},
    "whole-behind": {"shm": False},  # as to a server without then_pull: the pull behind
    "shm-behind": {"shm": True},
}


def connected(servers: str, path: str, worker: int = 0):
    """A client of `path`; "-behind" paths take the shards for servers older than then_pull."""
    client = connect(servers, worker=worker, **PATHS[path])
    if path.endswith("-behind"):
        for s in client.shards:
            s.info.then_pull = False
    return client


def updated(times: int) -> list[np.ndarray]:
    """The parameters after 0..times SGD updates of one G each (lr 1, in float32)."""
    out = [INIT.data.copy()]
    for _ in range(times):
        out.append(out[-1] - G)
    return out


EXPECTED = updated(16)


def expected(version: int) -> np.ndarray:
    """The exact parameters at `version` when every update is one G (BSP: the mean of G's)."""
    return EXPECTED[version]


@pytest.mark.parametrize("path", PATHS)
def test_fused_rounds_match_separate_pull_and_push(path):
    """The same rounds fused on one shard and apart on another: equal replies, pulled
    values and versions, equal stats (pulls, pushes, staleness histograms)."""
    K = 5
    with serve() as fused_daemons, serve() as apart_daemons:
        fused = connected(addresses(fused_daemons), path)
        apart = connect(addresses(apart_daemons), **PATHS[path])
        try:
            a, b = np.empty(N, np.float32), np.empty(N, np.float32)
            fused.pull(a)
            apart.pull(b)
            for step in range(K):
                replies, changed = fused.push_pull(G, step, a)
                (want,) = apart.push(G, step)
                assert replies[0] == want and not want.duplicate
                assert changed == apart.pull(b) == 1 and fused.versions == apart.versions
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(a, expected(step + 1))
            if path == "shm":
                assert fused.shards[0].shared_memory
            fs, ap = fused.stats()[0], apart.stats()[0]
        finally:
            fused.close()
            apart.close()
    for field in ("version", "updates", "pushes", "duplicates", "pulls", "pulls_not_modified",
                  "staleness", "bytes_received", "bytes_sent"):
        assert getattr(fs, field) == getattr(ap, field), field


@pytest.mark.parametrize("path", ["whole", "shm", "calls", "whole-behind"])
def test_a_repeated_push_pull_is_applied_once_and_pulls_not_modified(path):
    with serve() as daemons:
        client = connected(addresses(daemons), path)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)
            first, changed = client.push_pull(G, 0, params)
            assert not first[0].duplicate and first[0].version == 1 and changed == 1
            again, changed = client.push_pull(G, 0, params)  # a retry of the same step
            assert again[0].duplicate and again[0].version == 1 and changed == 0
            np.testing.assert_array_equal(params, expected(1))
            st = client.stats()[0]
            assert (st.pushes, st.duplicates, st.pulls_not_modified) == (1, 1, 1)
        finally:
            client.close()


def run_two_workers(mode: str, steps: int, path: str) -> tuple[list[list], list]:
    """Two workers pushing G `steps` times with push_pull; per worker, each round's
    (reply, pulled version, pulled values equal to expected(version)); the shard's stats."""
    server = {"consistency": mode, "num_workers": 2, **({"staleness": 1} if mode == "ssp"
                                                        else {})}
    with serve(**server) as daemons:
        clients = [connected(addresses(daemons), path, worker=w) for w in (0, 1)]
        seen, errors = [[], []], []

        def work(w: int) -> None:
            try:
                c, params = clients[w], np.empty(N, np.float32)
                c.pull(params)
                for step in range(steps):
                    replies, _ = c.push_pull(G, step, params)
                    version = c.versions[0]
                    # BSP averages the round's two gradients G: one G per version too
                    seen[w].append((replies[0], version,
                                    np.array_equal(params, expected(version))))
            except Exception as e:  # reported by the test thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(w,)) for w in (0, 1)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads) and not errors, errors
            stats = clients[0].stats()[0]
        finally:
            for c in clients:
                c.close()
    return seen, stats


@pytest.mark.parametrize("mode", ["asp", "ssp", "bsp"])
@pytest.mark.parametrize("path", ["whole", "shm", "shm-behind"])
def test_two_workers_fused_keep_the_consistency_rules(mode, path):
    K = 6
    seen, st = run_two_workers(mode, K, path)
    for rounds in seen:
        assert len(rounds) == K and all(exact for _, _, exact in rounds)  # values of their version
    replies = [r for rounds in seen for r, _, _ in rounds]
    assert not any(r.duplicate for r in replies)
    assert st.pushes == 2 * K and st.staleness.total == 2 * K  # every staleness recorded
    recorded = [s for s, n in st.staleness.counts.items() for _ in range(n)]
    assert sorted(recorded) == sorted(r.staleness for r in replies)
    if mode == "bsp":  # one update per round; a pull reads only completed rounds
        assert st.version == K and st.updates == K and st.max_clock_lead == 0
        assert all(r.staleness == 0 for r in replies)
        for rounds in seen:
            assert [v for _, v, _ in rounds] == list(range(1, K + 1))
    else:
        assert st.version == st.updates == 2 * K
        if mode == "ssp":
            assert st.max_clock_lead <= 1


def test_a_generated_stub_pushes_with_then_pull_and_reads_push_pulled():
    """Any client of the .proto: a WholePush with then_pull is answered in one PushPulled
    (the push's reply, the pull as a WholePull), checked like a pull of its own."""
    with serve() as daemons:
        address = addresses(daemons)
        connect(address).close()  # registers worker 0
        ch = grpc.insecure_channel(address)
        q = queue.SimpleQueue()
        replies = pb_grpc.ParameterServerStub(ch).Session(iter(q.get, None), timeout=20)
        try:
            grad = np.arange(N, dtype=np.float32)
            meta = pb.TensorMeta(dtype=pb.FLOAT32, shape=[N], offset=0, version=0)
            then = pb.PullRequest(registration=REG,
                                  worker_id=0, shard=0, known_version=0, whole_bytes=4 * N)
            q.put(pb.SessionRequest(push_whole=pb.WholePush(
                header=pb.PushHeader(registration=REG, worker_id=0, step=0, shard=0, meta=meta),
                chunk=pb.Chunk(start=0, data=grad.tobytes()),
                trailer=pb.Trailer(chunks=1, adler32=zlib.adler32(grad.tobytes())),
                then_pull=then)))
            answer = next(replies)
            assert answer.WhichOneof("kind") == "push_pulled"
            got = answer.push_pulled
            assert got.pushed.version == 1 and not got.pushed.duplicate
            assert got.header.meta.version == 1 and not got.header.not_modified
            assert (got.trailer.chunks, got.trailer.adler32) == (1, zlib.adler32(got.chunk.data))
            np.testing.assert_array_equal(np.frombuffer(got.chunk.data, np.float32),
                                          INIT.data - grad)
            # hand-made on the server: read alike by both codecs, the data aligned
            raw = answer.SerializeToString()
            for codec in wire.CODECS.values():
                kind, whole = codec.read(pb.SessionReply, raw)
                assert kind == "push_pulled" and whole.more["pushed"] == got.pushed
                assert bytes(whole.data) == got.chunk.data
            # a pull that may not come in one message: pushed, then the pull's stream
            then.whole_bytes, then.known_version = 0, 1
            meta.version = 1
            q.put(pb.SessionRequest(push_whole=pb.WholePush(
                header=pb.PushHeader(registration=REG, worker_id=0, step=1, shard=0, meta=meta),
                chunk=pb.Chunk(start=0, data=grad.tobytes()),
                trailer=pb.Trailer(chunks=1, adler32=zlib.adler32(grad.tobytes())),
                then_pull=then)))
            answers = [next(replies) for _ in range(4)]
            assert [a.WhichOneof("kind") for a in answers] == ["pushed", "header", "chunk",
                                                               "trailer"]
            assert answers[0].pushed.version == answers[1].header.meta.version == 2
            np.testing.assert_array_equal(np.frombuffer(answers[2].chunk.data, np.float32),
                                          INIT.data - grad - grad)
        finally:
            q.put(None)
            ch.close()


@pytest.mark.parametrize("make", ["hand", "generated"])
def test_then_pull_travels_in_the_whole_push_with_its_data_last_and_aligned(make):
    values = np.arange(1000, dtype=np.float32)
    header = pb.PushHeader(registration=REG, worker_id=3, step=7, shard=0, meta=pb.TensorMeta(
        dtype=pb.FLOAT32, shape=[1000]))
    then = pb.PullRequest(registration=REG,
                          worker_id=3, shard=0, known_version=5, whole_bytes=1 << 20)
    raw = wire.whole(pb.SessionRequest, "push_whole", header, values, wire.CODECS[make],
                     then_pull=then)
    if make == "hand":
        assert (len(raw) - values.nbytes) % wire.ALIGN == 0
    assert pb.SessionRequest.FromString(raw).push_whole.then_pull == then
    for codec in wire.CODECS.values():
        kind, whole = codec.read(pb.SessionRequest, raw)
        assert kind == "push_whole" and whole.more == {"then_pull": then}
        assert whole.header == header and bytes(whole.data) == values.tobytes()


@pytest.mark.parametrize("then, words", [
    ({"worker_id": 1}, "an operation of worker 1"),
    ({"shard": 4}, "shard 4: this server holds shard 0"),
    ({"known_version": 9}, "known_version 9 is from the future"),
])
def test_a_faulty_then_pull_is_refused_by_name_after_its_push(then, words):
    with serve(num_workers=2) as daemons:
        address = addresses(daemons)
        connect(address).close()
        connect(address, worker=1).close()
        ch = grpc.insecure_channel(address)
        q = queue.SimpleQueue()
        replies = pb_grpc.ParameterServerStub(ch).Session(iter(q.get, None), timeout=20)
        grad = np.ones(N, np.float32)
        try:
            q.put(pb.SessionRequest(push_whole=pb.WholePush(
                header=pb.PushHeader(registration=REG,
                                     worker_id=0, step=0, shard=0, meta=pb.TensorMeta(
                    dtype=pb.FLOAT32, shape=[N], offset=0, version=0)),
                chunk=pb.Chunk(start=0, data=grad.tobytes()),
                trailer=pb.Trailer(chunks=1, adler32=zlib.adler32(grad.tobytes())),
                then_pull=pb.PullRequest(**{"registration": REG,
                                            "worker_id": 0, "shard": 0, **then}))))
            with pytest.raises(grpc.RpcError) as e:
                next(replies)
            assert e.value.code() == C.INVALID_ARGUMENT and words in e.value.details()
        finally:
            q.put(None)
            ch.close()
        # the push itself was whole and valid: applied once, as a push of its own would be
        assert daemons[0].store.version == 1
        np.testing.assert_array_equal(daemons[0].store.params, INIT.data - grad)


def test_a_push_pull_interrupted_in_its_pull_is_retried_and_applied_once(tmp_path):
    """SSP with bound 0: worker 0's pull after its push waits for worker 1; the shard
    restarts from its checkpoint meanwhile (UNAVAILABLE), the retry finds the push
    applied (duplicate) and its pull served once worker 1 pushes."""
    ckpt = str(tmp_path / "ckpt")
    server = {"consistency": "ssp", "staleness": 0, "num_workers": 2, "checkpoint_dir": ckpt}
    with serve(**server) as daemons:
        port = daemons[0].port
        address = f"127.0.0.1:{port}"
        clients = [connect(address, worker=w, shm=False) for w in (0, 1)]
        params = [np.empty(N, np.float32) for _ in clients]
        for c, p in zip(clients, params, strict=True):
            c.pull(p)
        result = []
        first = threading.Thread(target=lambda: result.append(
            clients[0].push_pull(G, 0, params[0])))
        first.start()
        deadline = time.monotonic() + 20
        while daemons[0].store.stats().pushes < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemons[0].store.stats().pushes == 1  # applied; its pull waits for worker 1
    try:
        with serve(**server, resume=True, port=port) as daemons:
            assert daemons[0].store.version == 1
            deadline = time.monotonic() + 20
            while daemons[0].store.stats().duplicates < 1 and time.monotonic() < deadline:
                time.sleep(0.02)  # worker 0's retry, its pull waiting again for worker 1
            (second, *_), _ = clients[1].push_pull(G, 0, params[1])
            first.join(timeout=30)
            assert result, "worker 0's push_pull did not come back"
            (reply,), changed = result[0]
            assert reply.duplicate and reply.version == 1 and changed == 1
            assert clients[0].versions == [2] and second.version == 2
            np.testing.assert_array_equal(params[0], expected(2))
            st = daemons[0].store.stats()
            assert st.version == 2 and st.duplicates == 1
    finally:
        first.join(timeout=30)
        for c in clients:
            c.close()


@pytest.mark.parametrize("path", ["whole", "streamed", "shm"])
def test_two_shards_push_pull_from_one_thread_and_fall_back_to_retries(path, monkeypatch):
    """With every session open, PSClient.push_pull sends to both shards and reads both
    answers from the calling thread (no ShardClient.push_pull, whose retries it falls back
    to): exact values; a session broken under it costs that shard one retried push_pull,
    the push applied once."""
    retried = []
    real = ShardClient.push_pull

    def counted(self, *args, **kwargs):
        retried.append(self.address)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ShardClient, "push_pull", counted)
    with serve(shards=2) as daemons:
        client = connected(addresses(daemons), path)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)  # opens both sessions
            for step in range(3):
                replies, changed = client.push_pull(G, step, params)
                assert changed == 2 and not any(r.duplicate for r in replies)
            assert retried == [] and client.versions == [3, 3]
            np.testing.assert_array_equal(params, expected(3))
            if path == "shm":
                assert all(s.shared_memory for s in client.shards)
            client.shards[1]._session.call.cancel()  # the stream breaks under the client
            replies, changed = client.push_pull(G, 3, params)
            assert retried == [client.shards[1].address] and changed == 2
            np.testing.assert_array_equal(params, expected(4))
            assert [s.pushes for s in client.stats()] == [4, 4]  # each push applied once
        finally:
            client.close()
