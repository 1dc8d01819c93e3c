#!/usr/bin/env python3
"""What grpcurl does, from server reflection alone (no .proto files): list services,
describe pagedattn.v1.AttentionService, call ValidateCacheConfig with a JSON body, and
check grpc.health.v1. Needs grpcio, grpcio-reflection and protobuf (tooling, from PyPI).

  python3 tests/scripts/reflection_check.py 127.0.0.1:50051
"""
import json
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def main(target):
    channel = grpc.insecure_channel(target)
    db = ProtoReflectionDescriptorDatabase(channel)
    services = sorted(db.get_services())
    print("services:", services)
    for want in ("pagedattn.v1.AttentionService", "grpc.health.v1.Health",
                 "grpc.reflection.v1alpha.ServerReflection"):
        assert want in services, f"{want} not listed"

    pool = descriptor_pool.DescriptorPool(db)
    svc = pool.FindServiceByName("pagedattn.v1.AttentionService")
    methods = [m.name for m in svc.methods]
    print("AttentionService methods:", methods)
    for want in ("GetServerInfo", "ValidateCacheConfig", "CreateCache", "GetCache",
                 "ListCaches", "DeleteCache", "Forward", "ReleaseSequences"):
        assert want in methods, f"{want} missing from describe"

    method = svc.FindMethodByName("ValidateCacheConfig")
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    body = {"num_layers": 32, "num_q_heads": 32, "num_kv_heads": 5, "head_dim": 100,
            "page_size": 0, "kv_dtype": "BFLOAT16", "num_pages": 10}
    req = json_format.Parse(json.dumps(body), req_cls())
    call = channel.unary_unary("/pagedattn.v1.AttentionService/ValidateCacheConfig",
                               request_serializer=req_cls.SerializeToString,
                               response_deserializer=resp_cls.FromString)
    resp = json_format.MessageToDict(call(req, timeout=10))
    print("ValidateCacheConfig:", json.dumps(resp))
    fields = sorted(v["field"] for v in resp.get("violations", []))
    assert fields == ["head_dim", "num_q_heads", "page_size"], fields

    hpool_svc = pool.FindServiceByName("grpc.health.v1.Health")
    check = hpool_svc.FindMethodByName("Check")
    hreq_cls = message_factory.GetMessageClass(check.input_type)
    hresp_cls = message_factory.GetMessageClass(check.output_type)
    hcall = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=hreq_cls.SerializeToString,
                                response_deserializer=hresp_cls.FromString)
    status = json_format.MessageToDict(hcall(hreq_cls(), timeout=10))["status"]
    print("health:", status)
    assert status == "SERVING", status
    print("reflection_check: OK")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
