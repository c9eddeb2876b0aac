"""Bearer token (constant-time, health stays open) and TLS / mutual TLS, on real servers."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pserver_util import OPENSSL, addresses, connect, initial_params, make_cert, serve

from dtlab.models.config import ConfigError
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver import auth, wire

INIT = initial_params()
TOKEN = "s3cret-token"


def register_raw(address: str, metadata=()) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(f"/{wire.SERVICE}/Register", pb.RegisterRequest.SerializeToString,
                              pb.RegisterReply.FromString)
        req = pb.RegisterRequest(worker_id=5, model="mlp", model_size=INIT.size,
                                 layout_crc32=wire.layout_crc(INIT.specs))
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
