"""What the sync and asyncio clients share: channel options, TLS credentials, metadata, and
building a ForwardRequest / reading a ForwardResponse."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import grpc

from .tensors import ArrayLike, DTypeLike, fill_tensor, from_tensor
from .types import SpanLike, cache_id_of, span_protos
from .v1 import attention_pb2 as pb

# The server's default --max_message_mb (512 MiB); gRPC's own default receive limit is 4 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
DEFAULT_TIMEOUT_S = 60.0


@dataclass
class TLS:
    """TLS settings. `ca`: PEM roots (path or bytes; None: the system roots); `cert`/`key`:
    a client certificate for mTLS; `server_name`: overrides the name checked in the server's cert."""

    ca: Union[str, bytes, None] = None
    cert: Union[str, bytes, None] = None
    key: Union[str, bytes, None] = None
    server_name: Optional[str] = None


def _pem(x: Union[str, bytes, None]) -> Optional[bytes]:
    if x is None or isinstance(x, bytes):
        return x
    with open(os.fspath(x), "rb") as f:
        return f.read()


def channel_setup(
    tls: Union[bool, TLS, None], max_message_bytes: int, options: Sequence[tuple[str, Any]]
) -> tuple[Optional[grpc.ChannelCredentials], list[tuple[str, Any]]]:
    """(credentials or None for plaintext, channel options)."""
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    creds = None
    if tls:
        t = tls if isinstance(tls, TLS) else TLS()
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem(t.ca), private_key=_pem(t.key), certificate_chain=_pem(t.cert)
        )
        if t.server_name:
            opts.append(("grpc.ssl_target_name_override", t.server_name))
    return creds, opts + list(options)


def auth_metadata(token: Optional[str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def forward_request(
    cache: Any,
    layer: int,
    spans: Sequence[SpanLike],
    q: ArrayLike,
    k: Optional[ArrayLike],
    v: Optional[ArrayLike],
    causal: Optional[bool],
    sm_scale: Optional[float],
    return_lse: bool,
    dtype: Optional[DTypeLike],
) -> pb.ForwardRequest:
    req = pb.ForwardRequest(cache_id=cache_id_of(cache), layer=layer, spans=span_protos(spans))
    fill_tensor(req.q, q, dtype)
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (or neither, when no span appends tokens)")
    if k is not None:
        fill_tensor(req.k, k, dtype)
        fill_tensor(req.v, v, dtype)
    if causal is not None:
        req.options.causal = causal
    if sm_scale is not None:
        req.options.sm_scale = sm_scale
    req.options.return_lse = return_lse
    return req


def forward_result(resp: pb.ForwardResponse, q: ArrayLike, return_lse: bool) -> Any:
    out = from_tensor(resp.out, like=q)
    if not return_lse:
        return out
    return out, from_tensor(resp.lse, like=q)
