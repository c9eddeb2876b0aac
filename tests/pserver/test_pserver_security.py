"""Bearer token (constant-time, health stays open), TLS / mutual TLS, and registrations (no
client pulls or pushes as another worker), on real servers."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pserver_util import OPENSSL, addresses, connect, initial_params, make_cert, serve

from dtlab.models.config import ConfigError
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import auth
from dtlab.pserver.common import codec as wire

INIT = initial_params()
TOKEN = "s3cret-token"


def register_raw(address: str, metadata=()) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(f"/{wire.SERVICE}/Register", pb.RegisterRequest.SerializeToString,
                              pb.RegisterReply.FromString)
        req = pb.RegisterRequest(worker_id=5, model="mlp", model_size=INIT.size,
                                 layout_crc32=wire.layout_crc(INIT.specs), registration=0x5EC)
        try:
            call(req, timeout=20, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_token_is_required_except_for_health(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with serve(token_file=str(token_file)) as daemons:
        address = addresses(daemons)
        assert register_raw(address) == grpc.StatusCode.UNAUTHENTICATED
        assert register_raw(address, auth.call_metadata("wrong")) == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(address) as ch:  # a streaming method is refused too
            push = ch.stream_unary(f"/{wire.SERVICE}/Push")
            with pytest.raises(grpc.RpcError) as e:
                push(iter([b"\x0a\x00"]), timeout=20)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=20)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert not daemons[0].store.clocks.workers  # nothing registered by the refused calls
        assert register_raw(address, auth.call_metadata(TOKEN)) == grpc.StatusCode.OK

        monkeypatch.setenv("DTLAB_TEST_TOKEN", TOKEN)
        client = connect(address, worker=0, token_env="DTLAB_TEST_TOKEN")
        try:
            client.pull(np.empty(INIT.size, np.float32))
            assert client.push(np.ones(INIT.size, np.float32), 0)[0].version == 1
        finally:
            client.close()


def test_token_sources_are_checked(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        auth.read_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="--token-file"):
        auth.read_token(str(tmp_path / "missing"))
    assert auth.read_token() is None


needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="no openssl CLI to make a test cert")


@needs_openssl
def test_tls_server_certificate(tmp_path):
    cert, key = make_cert(tmp_path, "server")
    with serve(tls_cert=str(cert), tls_key=str(key)) as daemons:
        address = addresses(daemons)
        client = connect(address, tls_ca=str(cert))
        try:
            params = np.empty(INIT.size, np.float32)
            client.pull(params)
            np.testing.assert_array_equal(params, INIT.data)
        finally:
            client.close()
        with pytest.raises(TimeoutError, match="not serving"):  # plaintext cannot talk to it
            connect(address, connect_timeout_s=1.0)


@needs_openssl
def test_mutual_tls_requires_a_client_certificate(tmp_path):
    cert, key = make_cert(tmp_path, "server")
    ccert, ckey = make_cert(tmp_path, "worker")
    with serve(tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ccert)) as daemons:
        address = addresses(daemons)
        with pytest.raises(TimeoutError, match="not serving"):
            connect(address, tls_ca=str(cert), connect_timeout_s=1.0)
        other, other_key = make_cert(tmp_path, "stranger")
        with pytest.raises(TimeoutError, match="not serving"):
            connect(address, tls_ca=str(cert), tls_cert=str(other), tls_key=str(other_key),
                    connect_timeout_s=1.0)
        client = connect(address, tls_ca=str(cert), tls_cert=str(ccert), tls_key=str(ckey))
        client.close()


ONES = np.ones(INIT.size, np.float32)


def refusal(call) -> tuple[grpc.StatusCode, str]:
    """(status, details) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def as_worker_0(address: str, registration: int) -> list[tuple[grpc.StatusCode, str]]:
    """Every call naming worker 0 with `registration`: a Push, a Pull, a Session's pull,
    a Deregister; their (status, details)."""
    meta = pb.TensorMeta(dtype=pb.FLOAT32, shape=[INIT.size], offset=0, version=0)
    header = pb.PushHeader(worker_id=0, step=7, shard=0, meta=meta, registration=registration)
    pull = pb.PullRequest(worker_id=0, shard=0, registration=registration)
    with grpc.insecure_channel(address) as ch:
        push = ch.stream_unary(f"/{wire.SERVICE}/Push", None, pb.PushReply.FromString)
        pulling = ch.unary_stream(f"/{wire.SERVICE}/Pull", pb.PullRequest.SerializeToString)
        session = ch.stream_stream(f"/{wire.SERVICE}/Session")
        leave = ch.unary_unary(f"/{wire.SERVICE}/Deregister",
                               pb.DeregisterRequest.SerializeToString)
        return [
            refusal(lambda: push(iter(wire.stream(header, ONES)), timeout=20)),
            refusal(lambda: list(pulling(pull, timeout=20))),
            refusal(lambda: list(session(iter([pb.SessionRequest(pull=pull).SerializeToString()]),
                                         timeout=20))),
            refusal(lambda: leave(pb.DeregisterRequest(worker_id=0, registration=registration),
                                  timeout=20))]


def test_no_client_pulls_or_pushes_as_a_registered_worker_without_its_registration():
    """Worker 0 registered with its number: calls as worker 0 with 0 (which meant "unchecked"
    before) or with another number are refused, naming why, and nothing is applied."""
    with serve() as daemons:
        address, store = addresses(daemons), daemons[0].store
        client = connect(address)
        try:
            for code, details in as_worker_0(address, 0):
                assert code == grpc.StatusCode.INVALID_ARGUMENT, details
                assert "worker 0: registration 0" in details
            for code, details in as_worker_0(address, client.registration ^ 1):
                assert code == grpc.StatusCode.FAILED_PRECONDITION, details
                assert "registered by another process" in details
            code, details = refusal(lambda: register(address, 0))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "registration 0" in details
            assert store.version == 0 and store.stats().workers[0].active
            assert store.stats().rejected["registration"] == 5
            client.pull(np.empty(INIT.size, np.float32))  # the worker itself goes on
            assert client.push(ONES, 0)[0].version == 1
        finally:
            client.close()


def test_unchecked_registration_is_the_contract_before_the_check():
    with serve(unchecked_registration=True) as daemons:
        address, store = addresses(daemons), daemons[0].store
        client = connect(address)
        try:
            assert register(address, 0).worker_id == 1  # a client without a number
            meta = pb.TensorMeta(dtype=pb.FLOAT32, shape=[INIT.size], offset=0, version=0)
            header = pb.PushHeader(worker_id=0, step=0, shard=0, meta=meta)
            with grpc.insecure_channel(address) as ch:  # as worker 0, with no registration
                reply = ch.stream_unary(f"/{wire.SERVICE}/Push", None, pb.PushReply.FromString)(
                    iter(wire.stream(header, ONES)), timeout=20)
            assert reply.version == 1 and store.version == 1
        finally:
            client.close()


def register(address: str, registration: int) -> pb.RegisterReply:
    with grpc.insecure_channel(address) as ch:
        return ch.unary_unary(f"/{wire.SERVICE}/Register", pb.RegisterRequest.SerializeToString,
                              pb.RegisterReply.FromString)(
            pb.RegisterRequest(model="mlp", model_size=INIT.size,
                               layout_crc32=wire.layout_crc(INIT.specs),
                               registration=registration), timeout=20)
