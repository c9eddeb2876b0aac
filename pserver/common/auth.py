"""Who may talk to a parameter server: a bearer token and (mutual) TLS.

The token is read from a file (`--token-file`) or an environment variable
(`--token-env`), never from the command line, where `ps` would show it.
Clients send it as `authorization: Bearer <token>` metadata; the server's
interceptor compares it in constant time (hmac.compare_digest) and answers
UNAUTHENTICATED before the method runs, so a rejected call changes nothing.
The standard health service stays open, so load balancers and the client's
readiness wait need no secret.

TLS encrypts and authenticates the server (`--tls-cert`, `--tls-key`);
`--tls-client-ca` also requires client certificates signed by that CA
(mutual TLS).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

from dtlab.models.config import ConfigError

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
DENIED = "missing or wrong bearer token (authorization: Bearer <token>)"


def read_token(token_file: str = "", token_env: str = "") -> str | None:
    """The shared secret from --token-file or --token-env, None when neither is given."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"--token-file {token_file}: {e.strerror}") from None
        if not token:
            raise ConfigError(f"--token-file {token_file} is empty")
        return token
    if token_env:
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise ConfigError(f"--token-env {token_env}: the variable is unset or empty")
        return token
    return None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only refuses."""

    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_stream_rpc_method_handler(refuse)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the right bearer token, except the open prefixes."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_PREFIXES):
        self._expected = f"Bearer {token}".encode()
        self._open = open_prefixes

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(self._open):
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or ()
                      if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        return _deny(continuation(handler_call_details))


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror}") from None


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with the server's certificate; with `client_ca`, clients must present one too."""
    pair = [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))]
    if client_ca:
        return grpc.ssl_server_credentials(pair, _read(client_ca, "--tls-client-ca"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS trusting `ca` (system roots if empty), presenting `cert`/`key` for mutual TLS."""
    if bool(cert) != bool(key):
        raise ConfigError("--tls-cert and --tls-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "--tls-ca") if ca else None,
        private_key=_read(key, "--tls-key") if key else None,
        certificate_chain=_read(cert, "--tls-cert") if cert else None)
