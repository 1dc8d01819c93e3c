"""pagedattn: Python client of the pagedattn paged-attention gRPC service.

    import numpy as np, pagedattn
    with pagedattn.Client("localhost:50051") as client:
        config = pagedattn.CacheConfig(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                       page_size=16, kv_dtype="bfloat16", num_pages=64)
        with client.create_cache(config) as cache:            # deleted on exit
            q = np.random.randn(5, 8, 64).astype(np.float32)  # [queries, q heads, head_dim]
            k = v = np.random.randn(5, 2, 64).astype(np.float32)
            for layer in range(2):                            # a prefill of each layer
                out = cache.forward(layer, [pagedattn.Span.prefill(seq_id=1, num_tokens=5)],
                                    q, k, v)
            with cache.step([pagedattn.Span.decode(seq_id=1, position=5)]) as step:  # a stream
                outs = [step.submit(layer, q[:1], k[:1], v[:1]) for layer in range(2)]
                outs = [f.result() for f in outs]                 # answers in the order sent

pagedattn.ShardedClient splits a cache by KV head across several servers (pagedattn.sharded);
pagedattn.aio.Client (and aio.ShardedClient) is the asyncio twin; pagedattn.errors holds the
exceptions; pagedattn.v1 the generated protos (attention_pb2) and stub (attention_pb2_grpc).
"""

from . import errors
from ._common import DEFAULT_MAX_MESSAGE_BYTES, TLS, Timing, request_id
from .client import Cache, Client, LayerFuture, Step
from .device import DeviceMemory
from .errors import (
    CacheConfigError,
    ClientClosed,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfPages,
    PagedAttnError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .reference import reference_attention, relative_error
from .sharded import ShardedCache, ShardedClient, targets_from_dns
from .tensors import BFLOAT16, FLOAT16, FLOAT32, from_tensor, to_numpy, to_tensor, to_torch
from .types import CacheConfig, LayerAttention, Span
from .v1 import attention_pb2 as pb

__version__ = "0.1.0"

__all__ = [
    "BFLOAT16", "Cache", "CacheConfig", "CacheConfigError", "Client", "ClientClosed",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DeadlineExceeded", "DeviceMemory", "FLOAT16", "FLOAT32", "FailedPrecondition", "InvalidArgument",
    "LayerAttention", "LayerFuture", "NotFound", "OutOfPages", "PagedAttnError", "PermissionDenied",
    "ResourceExhausted", "ShardedCache", "ShardedClient", "Span", "Step", "TLS", "Timing",
    "Unauthenticated", "Unavailable", "errors", "from_tensor", "pb", "reference_attention",
    "relative_error", "request_id", "targets_from_dns", "to_numpy", "to_tensor", "to_torch",
]
