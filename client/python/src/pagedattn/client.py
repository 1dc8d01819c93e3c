"""pagedattn.Client: the blocking client of pagedattn.v1.AttentionService. Thread-safe: one
Client (one gRPC channel) can serve any number of threads at once."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import grpc

from . import _common
from ._common import TLS
from ._vendor.grpc.health.v1 import health_pb2, health_pb2_grpc
from .errors import from_rpc_error
from .tensors import ArrayLike, DTypeLike
from .types import ConfigLike, SpanLike, cache_id_of, config_proto
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc


class Client:
    """A connection to a pagedattn server.

    Args:
        target: "host:port" of the server.
        token: bearer token sent as `authorization: Bearer <token>` (servers with --auth_tokens_file).
        tls: False for plaintext, True for TLS with the system roots, or a `pagedattn.TLS`.
        timeout: default per-call deadline in seconds (None: no deadline).
        max_message_bytes: send/receive limit; defaults to the server's own maximum (512 MiB)
            instead of gRPC's 4 MiB receive limit.
        options: extra gRPC channel options, e.g. [("grpc.enable_retries", 0)].

    Errors are raised as pagedattn.errors exceptions (PagedAttnError and its subclasses).
    """

    def __init__(
        self,
        target: str = "localhost:50051",
        token: Optional[str] = None,
        *,
        tls: Union[bool, TLS] = False,
        timeout: Optional[float] = _common.DEFAULT_TIMEOUT_S,
        max_message_bytes: int = _common.DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = _common.auth_metadata(token)
        creds, opts = _common.channel_setup(tls, max_message_bytes, options)
        if creds is None:
            self.channel = grpc.insecure_channel(target, options=opts)
        else:
            self.channel = grpc.secure_channel(target, creds, options=opts)
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, method: Callable, request: Any, timeout: Optional[float]) -> Any:
        try:
            return method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the API -------------------------------------------------------------------------------

    def server_info(self, *, timeout: Optional[float] = None) -> pb.ServerInfo:
        """Version, backend ("cuda"/"cpu"), device, memory, and the capability table."""
        return self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def health(self, service: str = "", *, timeout: Optional[float] = None) -> bool:
        """grpc.health.v1 Check: True when the server reports SERVING."""
        resp = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def validate(
        self, config: ConfigLike, *, timeout: Optional[float] = None
    ) -> pb.ValidateCacheConfigResponse:
        """Dry run of create_cache: `valid`, every violation, and the pages/bytes it would take.
        Allocates nothing; an invalid config is an answer here, not an exception."""
        return self._call(self.stub.ValidateCacheConfig, config_proto(config), timeout)

    def create_cache(
        self,
        config: ConfigLike,
        name: str = "",
        *,
        delete_on_exit: bool = True,
        timeout: Optional[float] = None,
    ) -> "Cache":
        """Validates `config` and allocates the whole page pool. Raises CacheConfigError (with
        every violation) for an invalid config, ResourceExhausted when it does not fit.

        Returns a Cache handle; `with client.create_cache(...) as cache:` deletes the cache on
        exit unless `delete_on_exit=False`."""
        req = pb.CreateCacheRequest(config=config_proto(config), name=name)
        info = self._call(self.stub.CreateCache, req, timeout)
        return Cache(self, info, delete_on_exit=delete_on_exit)

    def get_cache(self, cache: Any, *, timeout: Optional[float] = None) -> pb.CacheInfo:
        """Config and live stats (free/used pages, live sequences, Forward calls) of a cache."""
        return self._call(self.stub.GetCache, pb.GetCacheRequest(cache_id=cache_id_of(cache)), timeout)

    def list_caches(self, *, timeout: Optional[float] = None) -> list[pb.CacheInfo]:
        """Every cache of this server (of the caller's tenant when auth is on), oldest first."""
        return list(self._call(self.stub.ListCaches, pb.ListCachesRequest(), timeout).caches)

    def delete_cache(self, cache: Any, *, timeout: Optional[float] = None) -> int:
        """Frees a cache; returns the bytes given back. In-flight Forwards on it finish first."""
        req = pb.DeleteCacheRequest(cache_id=cache_id_of(cache))
        return self._call(self.stub.DeleteCache, req, timeout).freed_bytes

    def forward(
        self,
        cache: Any,
        layer: int,
        spans: Sequence[SpanLike],
        q: ArrayLike,
        k: Optional[ArrayLike] = None,
        v: Optional[ArrayLike] = None,
        *,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        return_lse: bool = False,
        dtype: Optional[DTypeLike] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """Appends each span's new K/V to `layer` of the cache, then attends its queries.

        Args:
            cache: a Cache, a CacheInfo or a cache id.
            spans: Span / (seq_id, start, num_new_tokens, num_queries) per sequence, in the
                order of the rows of q and k/v.
            q: [total_queries, num_q_heads, head_dim], float32/float16/bfloat16 numpy array or
                torch tensor (float64 travels as float32; CUDA tensors through host memory).
            k, v: [total_new_tokens, num_kv_heads, head_dim], same dtype; None when no span
                appends tokens.
            causal: default True; sm_scale: default 1/sqrt(head_dim).
            return_lse: also return the log-sum-exp (natural log), [total_queries, num_q_heads]
                float32.
            dtype: convert q, k and v to this wire dtype before sending (the output comes back
                in it).

        Returns:
            out, [total_queries, num_q_heads, head_dim] in q's (wire) dtype, the same kind of
            array as q (a torch tensor on q's device, or numpy); (out, lse) with return_lse.
        """
        req = _common.forward_request(
            cache, layer, spans, q, k, v, causal, sm_scale, return_lse, dtype
        )
        return _common.forward_result(self._call(self.stub.Forward, req, timeout), q, return_lse)

    def forward_raw(
        self, request: pb.ForwardRequest, *, timeout: Optional[float] = None
    ) -> pb.ForwardResponse:
        """Forward with the raw protos (tensors as bytes; see pagedattn.tensors)."""
        return self._call(self.stub.Forward, request, timeout)

    def release(
        self, cache: Any, seq_ids: Sequence[int], *, timeout: Optional[float] = None
    ) -> pb.ReleaseSequencesResponse:
        """Frees the sequences' pages in every layer: `released`, `freed_pages`, and the
        `unknown_seq_ids` that had no sequence (not an error)."""
        req = pb.ReleaseSequencesRequest(cache_id=cache_id_of(cache), seq_ids=list(seq_ids))
        return self._call(self.stub.ReleaseSequences, req, timeout)

    # A streaming step() -- every layer of one decode step over one bidirectional stream, so a
    # step costs one round trip setup instead of num_layers -- goes here once the server has a
    # step stream. Until then a step is one forward() per layer.
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Not available yet: the server has no step stream. Use forward() per layer."""
        raise NotImplementedError("step() needs the server's step stream; use forward() per layer")


class Cache:
    """A handle on one server-side cache: its `cache_id`, the CacheInfo from creation (`info`),
    and forward/release/refresh/delete bound to it. A context manager: deletes the cache on
    exit when created with delete_on_exit=True (the default)."""

    def __init__(self, client: Client, info: pb.CacheInfo, *, delete_on_exit: bool = True) -> None:
        self.client = client
        self.info = info
        self.cache_id: str = info.cache_id
        self.delete_on_exit = delete_on_exit
        self.deleted = False

    @property
    def config(self) -> pb.CacheConfig:
        """The config with defaults resolved (num_pages set)."""
        return self.info.config

    def forward(self, layer: int, spans: Sequence[SpanLike], q: ArrayLike, k: Any = None,
                v: Any = None, **kwargs: Any) -> Any:
        """Client.forward on this cache."""
        return self.client.forward(self, layer, spans, q, k, v, **kwargs)

    def release(self, seq_ids: Sequence[int], **kwargs: Any) -> pb.ReleaseSequencesResponse:
        """Client.release on this cache."""
        return self.client.release(self, seq_ids, **kwargs)

    def refresh(self, **kwargs: Any) -> pb.CacheInfo:
        """Fetches the current CacheInfo (live stats) and keeps it in `info`."""
        self.info = self.client.get_cache(self, **kwargs)
        return self.info

    def stats(self) -> pb.CacheStats:
        """The live stats, fetched now."""
        return self.refresh().stats

    def delete(self, **kwargs: Any) -> int:
        """Deletes the cache; returns the bytes freed."""
        freed = self.client.delete_cache(self, **kwargs)
        self.deleted = True
        return freed

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.delete_on_exit and not self.deleted:
            self.delete()

    def __repr__(self) -> str:
        return f"Cache(cache_id={self.cache_id!r}, name={self.info.name!r})"
