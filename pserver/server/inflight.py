"""The calls a shutting-down daemon lets finish, counted from the moment gRPC accepts them.

gRPC Python looks a new call's handler up on the server's serving thread (the
generic handlers' `service`) and only then hands it to a pool thread, which may
wait to be scheduled on a busy host; the handler itself may then wait on the
network for the call's first message. A count taken inside the handler misses
both windows: a shutdown that reads it as zero cancels a push whose header is
already on its way. `InFlight` wraps a generic handler and counts each call of
the wrapped methods from its lookup until it terminates (gRPC runs the
callbacks a call's context was given when its status is sent or it is cancelled).

A call cancelled by its client before its request arrived never runs its
behavior and stays counted; the shutdown then waits its --grace-s, no longer.
Long-lived streams (the Session) are left out: their operations are counted by
the servicer, and between operations they are idle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

import grpc


class InFlight(grpc.GenericRpcHandler):
    """`inner`'s methods, every call of them except `idle_streams` counted in `count`."""

    def __init__(self, inner: grpc.GenericRpcHandler, idle_streams: Collection[str] = ()):
        self.inner, self.idle_streams = inner, frozenset(idle_streams)
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def _add(self, n: int) -> None:
        with self._lock:
            self._count += n

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.inner.service(details)
        if handler is None or details.method.rsplit("/", 1)[-1] in self.idle_streams:
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
            ("stream" if handler.response_streaming else "unary")
        self._add(1)
        return handler._replace(**{kind: self._counted(getattr(handler, kind))})

    def _counted(self, behavior: Callable) -> Callable:
        def counted(request, context):
            if not context.add_callback(lambda: self._add(-1)):  # already terminated
                self._add(-1)
            return behavior(request, context)

        return counted
