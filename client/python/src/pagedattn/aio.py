"""pagedattn.aio.Client: the asyncio client (grpc.aio), the same API as pagedattn.Client with
coroutines. Create it inside the event loop that uses it; many calls may be in flight at once
(e.g. one Forward per sequence group with asyncio.gather)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import grpc
import grpc.aio

from . import _common
from ._common import TLS
from ._vendor.grpc.health.v1 import health_pb2, health_pb2_grpc
from .errors import from_rpc_error
from .tensors import ArrayLike, DTypeLike
from .types import ConfigLike, SpanLike, cache_id_of, config_proto
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc


class Client:
    """An asyncio connection to a pagedattn server; arguments as pagedattn.Client.

    `async with pagedattn.aio.Client(target) as client:` closes the channel on exit."""

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
            self.channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            self.channel = grpc.aio.secure_channel(target, creds, options=opts)
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def _call(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        try:
            return await method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from e

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def server_info(self, *, timeout: Optional[float] = None) -> pb.ServerInfo:
        """See pagedattn.Client.server_info."""
        return await self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    async def health(self, service: str = "", *, timeout: Optional[float] = None) -> bool:
        """See pagedattn.Client.health."""
        req = health_pb2.HealthCheckRequest(service=service)
        resp = await self._call(self._health.Check, req, timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def validate(
        self, config: ConfigLike, *, timeout: Optional[float] = None
    ) -> pb.ValidateCacheConfigResponse:
        """See pagedattn.Client.validate."""
        return await self._call(self.stub.ValidateCacheConfig, config_proto(config), timeout)

    async def create_cache(
        self,
        config: ConfigLike,
        name: str = "",
        *,
        delete_on_exit: bool = True,
        timeout: Optional[float] = None,
    ) -> "Cache":
        """See pagedattn.Client.create_cache; `async with` deletes the cache on exit."""
        req = pb.CreateCacheRequest(config=config_proto(config), name=name)
        info = await self._call(self.stub.CreateCache, req, timeout)
        return Cache(self, info, delete_on_exit=delete_on_exit)

    async def get_cache(self, cache: Any, *, timeout: Optional[float] = None) -> pb.CacheInfo:
        """See pagedattn.Client.get_cache."""
        req = pb.GetCacheRequest(cache_id=cache_id_of(cache))
        return await self._call(self.stub.GetCache, req, timeout)

    async def list_caches(self, *, timeout: Optional[float] = None) -> list[pb.CacheInfo]:
        """See pagedattn.Client.list_caches."""
        return list((await self._call(self.stub.ListCaches, pb.ListCachesRequest(), timeout)).caches)

    async def delete_cache(self, cache: Any, *, timeout: Optional[float] = None) -> int:
        """See pagedattn.Client.delete_cache."""
        req = pb.DeleteCacheRequest(cache_id=cache_id_of(cache))
        return (await self._call(self.stub.DeleteCache, req, timeout)).freed_bytes

    async def forward(
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
        """See pagedattn.Client.forward (same shapes, dtypes and result)."""
        req = _common.forward_request(
            cache, layer, spans, q, k, v, causal, sm_scale, return_lse, dtype
        )
        resp = await self._call(self.stub.Forward, req, timeout)
        return _common.forward_result(resp, q, return_lse)

    async def forward_raw(
        self, request: pb.ForwardRequest, *, timeout: Optional[float] = None
    ) -> pb.ForwardResponse:
        """See pagedattn.Client.forward_raw."""
        return await self._call(self.stub.Forward, request, timeout)

    async def release(
        self, cache: Any, seq_ids: Sequence[int], *, timeout: Optional[float] = None
    ) -> pb.ReleaseSequencesResponse:
        """See pagedattn.Client.release."""
        req = pb.ReleaseSequencesRequest(cache_id=cache_id_of(cache), seq_ids=list(seq_ids))
        return await self._call(self.stub.ReleaseSequences, req, timeout)

    # The streaming step() goes here too once the server has a step stream (see pagedattn.Client).
    async def step(self, *args: Any, **kwargs: Any) -> Any:
        """Not available yet: the server has no step stream. Use forward() per layer."""
        raise NotImplementedError("step() needs the server's step stream; use forward() per layer")


class Cache:
    """The asyncio twin of pagedattn.Cache (`async with` deletes on exit when asked)."""

    def __init__(self, client: Client, info: pb.CacheInfo, *, delete_on_exit: bool = True) -> None:
        self.client = client
        self.info = info
        self.cache_id: str = info.cache_id
        self.delete_on_exit = delete_on_exit
        self.deleted = False

    @property
    def config(self) -> pb.CacheConfig:
        return self.info.config

    async def forward(self, layer: int, spans: Sequence[SpanLike], q: ArrayLike, k: Any = None,
                      v: Any = None, **kwargs: Any) -> Any:
        return await self.client.forward(self, layer, spans, q, k, v, **kwargs)

    async def release(self, seq_ids: Sequence[int], **kwargs: Any) -> pb.ReleaseSequencesResponse:
        return await self.client.release(self, seq_ids, **kwargs)

    async def refresh(self, **kwargs: Any) -> pb.CacheInfo:
        self.info = await self.client.get_cache(self, **kwargs)
        return self.info

    async def stats(self) -> pb.CacheStats:
        return (await self.refresh()).stats

    async def delete(self, **kwargs: Any) -> int:
        freed = await self.client.delete_cache(self, **kwargs)
        self.deleted = True
        return freed

    async def __aenter__(self) -> "Cache":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.delete_on_exit and not self.deleted:
            await self.delete()

    def __repr__(self) -> str:
        return f"aio.Cache(cache_id={self.cache_id!r}, name={self.info.name!r})"
