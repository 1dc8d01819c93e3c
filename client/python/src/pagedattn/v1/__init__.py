"""pagedattn.v1: the generated messages (attention_pb2) and gRPC stub (attention_pb2_grpc) of
proto/pagedattn/v1/attention.proto. Both modules are written by the build hook (hatch_build.py);
they are not in the source tree."""
