"""Asking the other replica of a shard where it stands: its ReplicaStatus, which with a
term is also a primary dropping its backup (pserver.server.replication.primary), and,
when it gives no answer, whether anything listens at its address at all.

Silence is never taken for death (the other may be paused, or cut off); a refused
connection is: nothing listens on its port, so its process is gone. (A partition that
drops packets, a cut link or a firewall's DROP, is silence; one that answered them with a
reset, a REJECT rule between the replicas, would pass for death and is not supported.)
"""

from __future__ import annotations

import socket

import grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.server.replication.journal import REPLICATION

SILENT, GONE = "silent", "gone"  # no answer; nothing listens at the address


def status_call(channel: grpc.Channel):
    """The ReplicaStatus method on `channel`."""
    return channel.unary_unary(f"/{REPLICATION}/ReplicaStatus",
                               request_serializer=pb.ReplicaStatusRequest.SerializeToString,
                               response_deserializer=pb.ReplicaStatusReply.FromString)


def ask(address: str, metadata, timeout: float, term: int = 0,
        status=None) -> pb.ReplicaStatusReply | str:
    """The replica at `address`'s ReplicaStatus (term: the asking primary's, dropping it as
    its backup), or SILENT, or GONE; asked on a new connection, or with `status`
    (status_call) on one already open to `address` (a follower's own)."""
    if status is None:
        with grpc.insecure_channel(address) as ch:
            return ask(address, metadata, timeout, term, status_call(ch))
    try:
        return status(pb.ReplicaStatusRequest(term=term), timeout=timeout, metadata=metadata)
    except grpc.RpcError:
        pass
    except ValueError:  # that connection is closed: its owner stopped
        return SILENT
    return GONE if refused(address, timeout) else SILENT


def refused(address: str, timeout: float) -> bool:
    """Whether a TCP connection to host:port is refused (nothing listens there)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable, or no answer in time: not known to be gone
        return False
