"""Server reflection under v1 and v1alpha (pserver.server.reflection) on a real gRPC server.

A v1 client is a raw stream on /grpc.reflection.v1.ServerReflection/ServerReflectionInfo
(the two protos' messages are the same, so v1alpha's classes encode it); it lists the
services, fetches the file of dtlab's service by symbol and builds the service from it,
and resolves v1's own service to a file whose messages are v1alpha's, renamed. v1alpha
clients (grpcio-reflection's own descriptor database) still work. The same from a real
`dtlab-pserver serve --reflection` daemon.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from support.pserver_util import TINY_MLP_FLAGS, DaemonProcess

from dtlab.pserver.common.codec import SERVICE
from dtlab.pserver.server import reflection

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@pytest.fixture(scope="module")
def address():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    reflection.enable((SERVICE, HEALTH), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def ask(address: str, service: str, *requests: rpb.ServerReflectionRequest) -> list:
    """The replies to `requests`, in order, on one ServerReflectionInfo stream of `service`."""
    with grpc.insecure_channel(address) as ch:
        info = ch.stream_stream(f"/{service}/ServerReflectionInfo",
                                request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                response_deserializer=rpb.ServerReflectionResponse.FromString)
        return list(info(iter(requests), timeout=20))


def files(reply: rpb.ServerReflectionResponse) -> list[descriptor_pb2.FileDescriptorProto]:
    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
    return [descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in reply.file_descriptor_response.file_descriptor_proto]


def test_v1_lists_both_reflection_names_and_dtlab_service(address):
    listed, = ask(address, reflection.V1, rpb.ServerReflectionRequest(list_services=""))
    names = [s.name for s in listed.list_services_response.service]
    assert sorted(names) == sorted([SERVICE, HEALTH, reflection.V1, reflection.V1ALPHA])
    assert SERVICE == "dtlab.ps.v1.ParameterServer"


def test_v1_fetches_dtlab_service_by_symbol(address):
    reply, = ask(address, reflection.V1,
                 rpb.ServerReflectionRequest(file_containing_symbol=SERVICE))
    protos = {p.name: p for p in files(reply)}  # the file and what it imports
    pool = descriptor_pool.DescriptorPool()

    def add(name: str) -> None:  # its imports first
        proto = protos.pop(name, None)
        if proto is not None:
            for dependency in proto.dependency:
                add(dependency)
            pool.Add(proto)

    while protos:
        add(next(iter(protos)))
    service = pool.FindServiceByName(SERVICE)
    describe = service.FindMethodByName("Describe")
    assert describe.output_type.fields_by_name["layout_crc32_input"]
    assert {"Register", "Pull", "Push", "Session"} <= {m.name for m in service.methods}


def test_v1_resolves_itself_to_v1alpha_renamed(address):
    reply, = ask(address, reflection.V1, rpb.ServerReflectionRequest(file_containing_symbol=
                                                                     reflection.V1))
    v1, = files(reply)
    alpha = descriptor_pb2.FileDescriptorProto()
    rpb.DESCRIPTOR.CopyToProto(alpha)
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert v1.options.go_package.endswith("grpc_reflection_v1") and not v1.options.deprecated

    def shape(proto, package: str) -> list:
        return [(m.name, [(f.name, f.number, f.type, f.label, f.oneof_index,
                           f.type_name.replace(package, "P")) for f in m.field])
                for m in proto.message_type]

    assert shape(v1, ".grpc.reflection.v1.") == shape(alpha, ".grpc.reflection.v1alpha.")
    method, = v1.service[0].method
    assert (v1.service[0].name, method.name, method.input_type, method.client_streaming,
            method.server_streaming) == ("ServerReflection", "ServerReflectionInfo",
                                         ".grpc.reflection.v1.ServerReflectionRequest", True, True)


def test_v1_answers_several_requests_on_one_stream_and_not_found(address):
    by_name, unknown, listed = ask(
        address, reflection.V1,
        rpb.ServerReflectionRequest(file_by_filename="dtlab/protos/dtlab_ps.proto"),
        rpb.ServerReflectionRequest(file_containing_symbol="dtlab.ps.v1.NoSuchThing"),
        rpb.ServerReflectionRequest(list_services=""))
    assert any(SERVICE.rpartition(".")[2] in [s.name for s in p.service] for p in files(by_name))
    assert unknown.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert unknown.original_request.file_containing_symbol == "dtlab.ps.v1.NoSuchThing"
    assert len(listed.list_services_response.service) == 4


def test_v1alpha_still_works(address):
    with grpc.insecure_channel(address) as ch:
        reflected = ProtoReflectionDescriptorDatabase(ch)
        assert set(reflected.get_services()) == {SERVICE, HEALTH, reflection.V1,
                                                 reflection.V1ALPHA}
        pool = descriptor_pool.DescriptorPool(reflected)
        assert pool.FindServiceByName(SERVICE).FindMethodByName("Describe")
        assert pool.FindServiceByName(reflection.V1).FindMethodByName("ServerReflectionInfo")


def test_a_service_without_descriptor_is_named_before_anything_is_added():
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        with pytest.raises(ValueError, match="'dtlab.ps.v1.NoSuchService'"):
            reflection.enable((SERVICE, "dtlab.ps.v1.NoSuchService"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, \
                pytest.raises(grpc.RpcError) as e:
            ProtoReflectionDescriptorDatabase(ch).get_services()
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)


def test_the_daemon_serves_both(tmp_path):
    with DaemonProcess(tmp_path, [*TINY_MLP_FLAGS, "--reflection", "--grace-s", "1"]) as d:
        listed, found = ask(d.address, reflection.V1,
                            rpb.ServerReflectionRequest(list_services=""),
                            rpb.ServerReflectionRequest(file_containing_symbol=SERVICE))
        names = {s.name for s in listed.list_services_response.service}
        assert names == {SERVICE, HEALTH, reflection.V1, reflection.V1ALPHA}, names
        assert any(p.package == "dtlab.ps.v1" and p.service for p in files(found))
        with grpc.insecure_channel(d.address) as ch:
            reflected = ProtoReflectionDescriptorDatabase(ch)
            assert set(reflected.get_services()) == names
            assert descriptor_pool.DescriptorPool(reflected).FindServiceByName(SERVICE)
        assert d.terminate() == 0, d.output()
