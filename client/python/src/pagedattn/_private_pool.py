"""The private protobuf descriptor pool that pagedattn's vendored google.rpc and grpc.health.v1
messages live in, so they never collide with googleapis-common-protos or grpcio-health-checking."""

from google.protobuf import any_pb2, descriptor_pool, message_factory

POOL = descriptor_pool.DescriptorPool()
# google/rpc/status.proto imports Any: the pool needs it first, and (for the pure-Python
# protobuf runtime, which builds classes eagerly) a message class for this pool's copy of it.
POOL.AddSerializedFile(any_pb2.DESCRIPTOR.serialized_pb)
message_factory.GetMessageClass(POOL.FindMessageTypeByName("google.protobuf.Any"))
