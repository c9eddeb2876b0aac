"""gRPC server reflection under both of its service names, v1 and v1alpha.

The reflection protocol (gRPC, "GRPC Server Reflection Protocol", A15 and
grpc/reflection/v1/reflection.proto) has two service names:
`grpc.reflection.v1.ServerReflection`, the stable one that current clients
(grpcurl, grpcui, Postman) ask first, and `grpc.reflection.v1alpha.ServerReflection`,
the one older clients know. The two protos declare the same messages with the
same fields and numbers, so one implementation serves both; grpcio-reflection
(1.85) ships only v1alpha, and `enable` serves its servicer under the v1 name
too (one bidirectional stream, ServerReflectionInfo, with v1alpha's message
classes on the wire).

Both names are listed by ListServices and both resolve by symbol: the
descriptors come from a pool of their own, holding the files of the given
services (and what they import), v1alpha's reflection.proto and a v1 copy of
it (package and type names renamed, options as in the v1 proto), so nothing
is added to protobuf's default pool.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable(service_names: Iterable[str], server: grpc.Server) -> None:
    """Serve reflection on `server` (before it starts) under V1 and V1ALPHA, listing
    `service_names` (fully qualified; their generated `_pb2` modules imported) and both
    reflection names. ValueError naming the service when one has no descriptor, before
    anything is added to `server`."""
    names = sorted({*service_names, V1ALPHA, V1})
    servicer = reflection.ReflectionServicer(names, pool=_pool(set(names) - {V1ALPHA, V1}))
    methods = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)}
    server.add_generic_rpc_handlers(tuple(grpc.method_handlers_generic_handler(name, methods)
                                          for name in (V1, V1ALPHA)))


def _pool(service_names: set[str]) -> descriptor_pool.DescriptorPool:
    """A pool of the services' files and their imports (from the default pool), plus
    v1alpha's reflection.proto and its v1 copy."""
    default = descriptor_pool.Default()
    files = [v1alpha_pb2.DESCRIPTOR]
    for name in sorted(service_names):
        try:
            files.append(default.FindServiceByName(name).file)
        except KeyError:
            raise ValueError(f"reflection: no descriptor for service {name!r} (is its _pb2 "
                             "module imported?)") from None
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(file) -> None:  # its imports first, as a pool requires
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for file in files:
        add(file)
    pool.Add(_v1_proto())
    return pool


def _v1_proto() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file with package grpc.reflection.v1
    (its messages, fields and numbers unchanged) and the v1 file's options."""
    old, new = f".{v1alpha_pb2.DESCRIPTOR.package}.", ".grpc.reflection.v1."
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, new.strip(".")
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = new + f.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    return proto
