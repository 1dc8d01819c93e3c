"""pagedattn.aio.Client: the asyncio client (grpc.aio), the same API as pagedattn.Client with
coroutines. Create it inside the event loop that uses it; many calls may be in flight at once
(e.g. one Forward per sequence group with asyncio.gather). pagedattn.aio.ShardedClient is the
twin of pagedattn.ShardedClient (a cache split by head across servers)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Generator, Optional, Sequence, Union

import grpc
import grpc.aio

from . import _common, device, sharded
from ._common import TLS, Timing
from ._vendor.grpc.health.v1 import health_pb2, health_pb2_grpc
from .errors import (
    ClientClosed, DeadlineExceeded, NotFound, PagedAttnError, Unavailable, from_rpc_error,
)
from .tensors import ArrayLike, DTypeLike
from .types import (
    ConfigLike, LengthsLike, SpanLike, cache_id_of, checked_int32, config_proto, seq_id_list,
    sequence_lengths, span_protos,
)
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc



def _being_cancelled() -> bool:
    """Whether the current task was asked to cancel (Python 3.11+; before it, never known)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


def _closed_in_flight() -> PagedAttnError:
    """What a call gets when its client's close() cancelled it (grpc.aio raises CancelledError
    then, in a task nobody cancelled): the sync client's error."""
    return PagedAttnError("the client was closed while this call was in flight",
                          grpc.StatusCode.CANCELLED)

_END = object()  # the end of a Step's outbox: half-closes the stream

# grpc.aio's status of a stream whose message could not be written because the stream had
# ended: it replaces the status the stream ended with (grpc/grpc#36066).
_WRITE_FAILED = (grpc.StatusCode.INTERNAL, "Internal error from Core")

# Tasks the loop must finish though nothing else holds them: a Step's writer, which refers to
# its outbox and call but not to the Step, so that a Step dropped open is collected (its
# __del__ cancels the call and the writer) and the writer ends as a task, not destroyed pending.
_live_tasks: "set[asyncio.Task]" = set()


def _keep_until_done(task: "asyncio.Task") -> "asyncio.Task":
    _live_tasks.add(task)
    task.add_done_callback(_live_tasks.discard)
    return task


async def _write_all(outbox: "asyncio.Queue[Any]", call: Any) -> None:
    """A Step's outbox to its stream, in order; _END half-closes it. Stops where the stream
    ends: reading it says why."""
    try:
        while True:
            request = await outbox.get()
            if request is _END:
                await call.done_writing()
                return
            await call.write(request)
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError, asyncio.CancelledError):
        pass


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
        _common.check_target(target)
        self.target = target
        _common.check_timeout(timeout)
        self.timeout = timeout
        self._metadata = _common.auth_metadata(token)
        creds, opts = _common.channel_setup(tls, max_message_bytes, options)
        # What this channel takes in: gRPC's "Received message larger than max (A vs. B)" with
        # another B was a server's refusal of the request (ShardedClient rolls nothing back).
        self.receive_limit: Optional[int] = _common.receive_limit(opts)
        if creds is None:
            self.channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            self.channel = grpc.aio.secure_channel(target, creds, options=opts)
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this client of {self.target} is closed (close() or the end of "
                               "its `async with` block); make a new Client")

    async def _call(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        self._check_open()
        if timeout is not None:
            _common.check_timeout(timeout)
        try:
            return await method(
                request,
                timeout=_common.grpc_timeout(self.timeout, timeout),
                metadata=_common.call_metadata(self._metadata),
            )
        except grpc.aio.AioRpcError as e:
            raise _common.call_error(from_rpc_error(e), self.target) from e
        except asyncio.CancelledError:
            if self._closed and not _being_cancelled():
                raise _closed_in_flight() from None
            raise

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled, later calls raise ClientClosed."""
        self._closed = True
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
        _common.check_cache_name(name)
        req = pb.CreateCacheRequest(config=config_proto(config), name=name)
        info = await self._call(self.stub.CreateCache, req, timeout)
        return Cache(self, info, delete_on_exit=delete_on_exit)

    async def get_cache(self, cache: Any, *, timeout: Optional[float] = None) -> pb.CacheInfo:
        """See pagedattn.Client.get_cache."""
        req = pb.GetCacheRequest(cache_id=cache_id_of(cache))
        return await self._call(self.stub.GetCache, req, timeout)

    async def list_caches(
        self, *, page_size: int = 0, timeout: Optional[float] = None
    ) -> list[pb.CacheInfo]:
        """See pagedattn.Client.list_caches."""
        caches: list[pb.CacheInfo] = []
        req = pb.ListCachesRequest(page_size=checked_int32("page_size", page_size))
        while True:
            resp = await self._call(self.stub.ListCaches, req, timeout)
            caches.extend(resp.caches)
            if not resp.next_page_token:
                return caches
            req.page_token = resp.next_page_token

    async def delete_cache(self, cache: Any, *, timeout: Optional[float] = None) -> int:
        """See pagedattn.Client.delete_cache."""
        req = pb.DeleteCacheRequest(cache_id=cache_id_of(cache))
        return (await self._call(self.stub.DeleteCache, req, timeout)).freed_bytes

    async def forward(
        self,
        cache: Any,
        layer: int,
        spans: Sequence[SpanLike],
        q: Optional[ArrayLike],
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
        req = pb.ReleaseSequencesRequest(cache_id=cache_id_of(cache), seq_ids=seq_id_list(seq_ids))
        return await self._call(self.stub.ReleaseSequences, req, timeout)

    async def truncate(
        self, cache: Any, layer: int, lengths: LengthsLike, *, timeout: Optional[float] = None
    ) -> pb.TruncateSequencesResponse:
        """See pagedattn.Client.truncate."""
        req = pb.TruncateSequencesRequest(
            cache_id=cache_id_of(cache), layer=checked_int32("layer", layer), lengths=sequence_lengths(lengths)
        )
        return await self._call(self.stub.TruncateSequences, req, timeout)

    async def register_memory(
        self, cache: Any, buffer: Any, *, lease_seconds: int = 0, timeout: Optional[float] = None
    ) -> device.DeviceMemory:
        """See pagedattn.Client.register_memory (`await memory.close()` to unregister)."""
        req, base, keep = device.register_request(cache_id_of(cache), buffer, lease_seconds)
        region = await self._call(self.stub.RegisterMemory, req, timeout)
        return device.DeviceMemory(self, region, base, keep)

    async def unregister_memory(self, region_id: str, *, timeout: Optional[float] = None) -> None:
        await self._call(self.stub.UnregisterMemory,
                         pb.UnregisterMemoryRequest(region_id=region_id), timeout)

    async def forward_device(
        self,
        cache: Any,
        layer: int,
        spans: Sequence[SpanLike],
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any = None,
        *,
        memory: device.DeviceMemory,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """See pagedattn.Client.forward_device."""
        req = device.device_request(memory, cache_id_of(cache), layer, span_protos(spans), q, k,
                                    v, out, lse, causal, sm_scale)
        await self._call(self.stub.Forward, req, timeout)

    def step(
        self,
        cache: Any,
        spans: Sequence[SpanLike],
        *,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        return_lse: bool = False,
        dtype: Optional[DTypeLike] = None,
        timeout: Optional[float] = None,
    ) -> "Step":
        """See pagedattn.Client.step: `async with client.step(cache, spans) as step:` then
        `out = await step.forward(layer, q, k, v)`, or `f = await step.submit(...)` for every
        layer first and `await f` (or `await f.result()`) after."""
        _common.check_timeout(timeout)
        return Step(self, cache, spans, causal=causal, sm_scale=sm_scale, return_lse=return_lse,
                    dtype=dtype, timeout=self.timeout if timeout is None else timeout)


class LayerFuture(_common.LayerAnswer):
    """See pagedattn.client.LayerFuture; `await future` is `await future.result()`."""

    def __init__(self, step: "Step", layer: int, like: Any, return_lse: bool) -> None:
        super().__init__(layer, like, return_lse)
        self._step = step

    async def result(self) -> Any:
        """See pagedattn.client.LayerFuture.result."""
        await self._step._wait(self)
        if self._failed is not None:
            self._step._error_seen = True
        return self._outcome()

    def __await__(self) -> Generator[Any, None, Any]:
        return self.result().__await__()


class Step:
    """The asyncio twin of pagedattn.client.Step, for tasks of one event loop. The stream
    opens at `async with` (or at the first submit). Messages go out from a task of their own,
    so that sending every layer before reading any answer never waits for the reads (the
    server stops reading while its answers wait to be read)."""

    def __init__(
        self,
        client: Client,
        cache: Any,
        spans: Sequence[SpanLike],
        *,
        causal: Optional[bool],
        sm_scale: Optional[float],
        return_lse: bool,
        dtype: Optional[DTypeLike],
        timeout: Optional[float],
    ) -> None:
        self.client = client
        self.cache_id = cache_id_of(cache)
        self.last_timing: Optional[Timing] = None  # of the last answer read
        self._timeout = timeout
        self._messages = _common.StepMessages()
        self._messages.begin(cache, spans, causal, sm_scale, return_lse, dtype)
        self._pending: deque[LayerFuture] = deque()  # sent, not answered, in order
        self._outbox: "asyncio.Queue[Any]" = asyncio.Queue()  # messages, then _END
        self._writer: Optional[asyncio.Task] = None  # writes the outbox to the call
        # The read of the next answer, one at a time, shared by its waiters (_read_task).
        self._reading: Optional[asyncio.Future] = None
        self._call: Any = None  # the grpc.aio call, once opened
        self._closed = False
        self._cancelled = False
        self._finished = False
        self._failure: Optional[PagedAttnError] = None
        self._error_seen = False

    def _open(self) -> Any:
        if self._call is None:
            self.client._check_open()
            self._call = self.client.stub.Step(timeout=_common.grpc_timeout(self._timeout, None),
                                               metadata=_common.call_metadata(self.client._metadata))
            self._writer = _keep_until_done(
                asyncio.get_running_loop().create_task(_write_all(self._outbox, self._call)))
        return self._call

    def begin(
        self,
        spans: Sequence[SpanLike],
        *,
        cache: Any = None,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        return_lse: bool = False,
    ) -> None:
        """See pagedattn.client.Step.begin."""
        if self._closed:
            raise RuntimeError("the Step stream is closed")
        # The stream's cache named again (see pagedattn.client.Step.begin).
        self._messages.begin(self.cache_id if cache is None else cache, spans, causal, sm_scale,
                             return_lse, self._messages.dtype)
        if cache is not None:
            self.cache_id = cache_id_of(cache)

    async def submit(
        self, layer: int, q: Optional[ArrayLike], k: Optional[ArrayLike] = None,
        v: Optional[ArrayLike] = None,
    ) -> LayerFuture:
        """See pagedattn.client.Step.submit (the message is queued for the stream's writer
        task; it goes out in the order submitted)."""
        if self._failure is not None:
            self._error_seen = True
            raise self._failure
        self.client._check_open()  # ClientClosed, as the blocking Step raises
        if self._closed:
            raise RuntimeError("the Step stream is closed")
        request = self._messages.request(layer, q, k, v)
        future = LayerFuture(self, layer, q, self._messages.return_lse)
        self._open()
        self._pending.append(future)
        self._outbox.put_nowait(request)
        self._messages.sent()
        # The writer starts sending it now, not at the caller's next wait: while the caller
        # encodes the next layers the server receives and runs this one.
        await asyncio.sleep(0)
        return future

    async def forward(
        self, layer: int, q: Optional[ArrayLike], k: Optional[ArrayLike] = None,
        v: Optional[ArrayLike] = None,
    ) -> Any:
        """See pagedattn.client.Step.forward."""
        return await (await self.submit(layer, q, k, v)).result()

    async def close(self) -> None:
        """See pagedattn.client.Step.close. A caller cancelled while close() reads the answers
        left (a timeout around `async with step:`) cancels the stream, as one cancelled in the
        block does: the layers not yet run are not run."""
        try:
            await self._close()
        except asyncio.CancelledError:
            self.cancel()
            raise

    async def _close(self) -> None:
        already, self._closed = self._closed, True
        if self._call is None:  # never opened: nothing was sent
            self._finished = True
            return
        if not already:
            self._outbox.put_nowait(_END)
        while self._failure is None and self._pending:
            await asyncio.shield(self._read_task())
        if self._failure is None and not self._finished:
            if self._reading is not None and not self._reading.done():
                await asyncio.shield(self._reading)  # a close() racing another close()
            try:
                extra = await self._call.read() if not self._finished else grpc.aio.EOF
            except grpc.aio.AioRpcError as e:
                self._fail(self._stream_error(e))
            except asyncio.CancelledError:
                if not self.client._closed or self._cancelled or _being_cancelled():
                    raise
                self._fail(_closed_in_flight())  # the channel's close() cancelled the call
            else:
                if extra is grpc.aio.EOF:
                    self._finished = True
                else:
                    self._fail(PagedAttnError("the Step stream answered a message never sent",
                                              grpc.StatusCode.INTERNAL))
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        if self._failure is not None and not self._error_seen:
            self._error_seen = True
            raise self._failure

    def cancel(self) -> None:
        """See pagedattn.client.Step.cancel."""
        if self._finished or self._failure is not None:
            return
        self._closed = self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        if self._writer is not None:
            self._writer.cancel()
        self._fail(PagedAttnError("the Step stream was cancelled", grpc.StatusCode.CANCELLED))
        self._error_seen = True

    @property
    def closed(self) -> bool:
        """True once close() or cancel() was called, the stream failed or its client closed."""
        return self._closed or self._failure is not None or self.client._closed

    async def __aenter__(self) -> "Step":
        self._open()
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()

    def __repr__(self) -> str:
        return f"aio.Step(cache_id={self.cache_id!r}, pending={len(self._pending)})"

    def __del__(self) -> None:
        # Dropped open (no close() or cancel()): end the call, as the blocking Step does, so
        # that it does not stay open on the server until the channel closes.
        try:
            if self._call is not None and not self._finished and self._failure is None:
                self._call.cancel()
            if self._writer is not None and not self._writer.done():
                self._writer.cancel()
        except Exception:  # the loop is gone: the channel's close ends it
            pass

    def _read_task(self) -> "asyncio.Future[None]":
        """The read of the next answer, started if none is in flight. Its waiters await it
        through asyncio.shield: a waiter cancelled (asyncio.wait_for) leaves the read, and the
        stream, going (grpc.aio cancels the whole call when a read() is cancelled)."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_one())
        return self._reading

    async def _wait(self, future: LayerFuture) -> None:
        while not future.done():
            await asyncio.shield(self._read_task())

    async def _read_one(self) -> None:
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as e:
            self._fail(self._stream_error(e))
            return
        except asyncio.CancelledError:
            if self.client._closed and not self._cancelled and not _being_cancelled():
                self._fail(_closed_in_flight())  # the channel's close() cancelled the call
                return
            if not self._cancelled:  # this task was cancelled, not the stream
                raise
            resp = grpc.aio.EOF  # read() raises CancelledError on a stream cancel() ended
        if resp is grpc.aio.EOF:
            self._fail(PagedAttnError("the Step stream ended before answering every message",
                                      grpc.StatusCode.INTERNAL))
            return
        future = self._pending.popleft() if self._pending else None
        if future is None:
            self._fail(PagedAttnError("the Step stream answered a message never sent",
                                      grpc.StatusCode.INTERNAL))
            return
        future._answer(resp)
        self.last_timing = future.timing

    def _stream_error(self, e: grpc.aio.AioRpcError) -> PagedAttnError:
        """The exception for the stream's end. Where grpc.aio lost the status (_WRITE_FAILED),
        what the call still tells: its deadline passed, or the connection is gone (Unavailable,
        as the blocking Step raises), else the server ended the stream."""
        if (e.code(), e.details()) != _WRITE_FAILED:
            return _common.stream_error(from_rpc_error(e), self.client.target, self._timeout)
        remaining = self._call.time_remaining()
        if remaining is not None and remaining <= 0:
            return _common.stream_error(DeadlineExceeded(
                "Deadline Exceeded", grpc.StatusCode.DEADLINE_EXCEEDED), self.client.target,
                self._timeout)
        if self.client.channel.get_state() != grpc.ChannelConnectivity.READY:
            return _common.stream_error(Unavailable(
                "the connection to the server was lost", grpc.StatusCode.UNAVAILABLE),
                self.client.target, self._timeout)
        where = f"the Step stream to {self.client.target}"
        return PagedAttnError(
            f"the server ended {where} while layers were still being sent, and gRPC lost the "
            "status it ended it with (it says only \"Internal error from Core\"); a unary "
            "forward() of the layer says why", grpc.StatusCode.INTERNAL)

    def _fail(self, error: PagedAttnError) -> None:
        if self._failure is None:
            self._failure = error
        self._closed = True
        self._outbox.put_nowait(_END)  # the writer stops (at the latest) here
        pending = list(self._pending)
        self._pending.clear()
        for future in pending:
            future._failed = self._failure


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

    async def forward(self, layer: int, spans: Sequence[SpanLike], q: Optional[ArrayLike], k: Any = None,
                      v: Any = None, **kwargs: Any) -> Any:
        return await self.client.forward(self, layer, spans, q, k, v, **kwargs)

    def step(self, spans: Sequence[SpanLike], **kwargs: Any) -> Step:
        return self.client.step(self, spans, **kwargs)

    async def release(self, seq_ids: Sequence[int], **kwargs: Any) -> pb.ReleaseSequencesResponse:
        return await self.client.release(self, seq_ids, **kwargs)

    async def truncate(self, layer: int, lengths: LengthsLike,
                       **kwargs: Any) -> pb.TruncateSequencesResponse:
        return await self.client.truncate(self, layer, lengths, **kwargs)

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

    async def __aexit__(self, exc_type: Any, error: Any, tb: Any) -> None:
        if self.delete_on_exit and not self.deleted:
            try:
                await self.delete()
            except NotFound:  # gone already (its server restarted, say): nothing is left behind
                self.deleted = True
            except (Exception, asyncio.CancelledError) as e:  # a second cancel lands here too
                if exc_type is None:
                    raise
                _common.cleanup_failed_during(error, e, f"the cache {self.cache_id}")

    def __repr__(self) -> str:
        return f"aio.Cache(cache_id={self.cache_id!r}, name={self.info.name!r})"


class ShardedClient(sharded._ShardedClientBase):
    """The asyncio twin of pagedattn.ShardedClient (arguments as there; a list of targets may
    hold pagedattn.aio.Client objects). Create it inside the event loop that uses it;
    `async with` closes the channels it opened."""

    def __init__(
        self,
        targets: sharded.TargetsLike,
        token: Optional[str] = None,
        *,
        tls: Union[bool, TLS] = False,
        timeout: Optional[float] = _common.DEFAULT_TIMEOUT_S,
        max_message_bytes: int = _common.DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._connect(Client, targets, token, tls, timeout, max_message_bytes, options)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._owned))

    async def __aenter__(self) -> "ShardedClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def fan_out(
        self, method: str, requests: Sequence[Optional[Any]], timeout: Optional[float] = None
    ) -> list[Any]:
        """See pagedattn.ShardedClient.fan_out: the calls run concurrently (asyncio.gather)."""

        async def one(client: Client, request: Any) -> Any:
            if request is None:
                return None
            return await client._call(getattr(client.stub, method), request, timeout)

        return list(await asyncio.gather(
            *(one(c, r) for c, r in zip(self.clients, requests)), return_exceptions=True))

    async def _each(self, method: str, requests: Sequence[Any], timeout: Optional[float],
                    doing: str) -> list[Any]:
        outcomes = await self.fan_out(method, requests, timeout)
        sharded._raise_first_failure(outcomes, self.targets, doing)
        return outcomes

    async def server_info(self, *, timeout: Optional[float] = None) -> list[pb.ServerInfo]:
        """See pagedattn.ShardedClient.server_info."""
        return await self._each("GetServerInfo", [pb.GetServerInfoRequest()] * self.num_shards,
                                timeout, "in GetServerInfo")

    async def validate(
        self, config: ConfigLike, *, timeout: Optional[float] = None
    ) -> list[pb.ValidateCacheConfigResponse]:
        """See pagedattn.ShardedClient.validate."""
        return await self._each("ValidateCacheConfig",
                                sharded.shard_configs(config, self.num_shards), timeout,
                                "in ValidateCacheConfig")

    async def create_cache(
        self,
        config: ConfigLike,
        name: str = "",
        *,
        delete_on_exit: bool = True,
        timeout: Optional[float] = None,
    ) -> "ShardedCache":
        """See pagedattn.ShardedClient.create_cache; `async with` deletes on exit."""
        _common.check_cache_name(name)
        configs = sharded.shard_configs(config, self.num_shards)
        error = sharded.validation_error(
            await self.fan_out("ValidateCacheConfig", configs, timeout), self.targets)
        if error is not None:
            raise error from getattr(error, "original", None)
        outcomes = await self.fan_out("CreateCache", self._create_requests(configs, name),
                                      timeout)
        if sharded._failed(outcomes):
            created = self._undo_requests(outcomes)
            deleted = await self.fan_out("DeleteCache", created, timeout)
            error = self._create_failure(outcomes, created, deleted)
            raise error from error.original
        shards = [Cache(c, info, delete_on_exit=False) for c, info in zip(self.clients, outcomes)]
        return ShardedCache(self, shards, delete_on_exit=delete_on_exit)


class ShardedCache(sharded._ShardedCacheBase):
    """The asyncio twin of pagedattn.ShardedCache (`async with` deletes on exit when asked)."""

    client: ShardedClient

    async def forward(
        self,
        layer: int,
        spans: Sequence[SpanLike],
        q: Optional[ArrayLike],
        k: Optional[ArrayLike] = None,
        v: Optional[ArrayLike] = None,
        *,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        return_lse: bool = False,
        dtype: Optional[DTypeLike] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """See pagedattn.ShardedCache.forward (the same split, join, rollback and errors). A
        forward cancelled while its calls are out (asyncio.wait_for, Task.cancel) rolls every
        shard back as a failed one does, then lets the cancellation go on."""
        spans = span_protos(spans)
        requests, likes = self._forward_requests(layer, spans, q, k, v, causal, sm_scale,
                                                 return_lse, dtype)
        try:
            outcomes = await self.client.fan_out("Forward", requests, timeout)
        except asyncio.CancelledError:
            # The shards' calls are cancelled with this one, some perhaps after writing: the
            # rollback runs in a task of its own, which a second cancellation does not stop.
            undo = self._rollback_requests(layer, spans, [asyncio.CancelledError()])
            if undo is not None:
                rollback_task = asyncio.ensure_future(
                    self.client.fan_out("TruncateSequences", undo, timeout))
                try:
                    await asyncio.shield(rollback_task)
                except asyncio.CancelledError:
                    pass  # cancelled again: the rollback goes on
            raise
        if not sharded._failed(outcomes):
            return self._forward_answer(outcomes, likes, return_lse)
        undo = self._rollback_requests(layer, spans, outcomes)
        rollback = None if undo is None else await self.client.fan_out(
            "TruncateSequences", undo, timeout)
        error = sharded.forward_failure(outcomes, self.targets, rollback)
        raise error from error.original

    async def release(self, seq_ids: Sequence[int], *,
                      timeout: Optional[float] = None) -> list[pb.ReleaseSequencesResponse]:
        """See pagedattn.ShardedCache.release."""
        return await self.client._each("ReleaseSequences", self._release_requests(seq_ids),
                                       timeout, "in ReleaseSequences")

    async def truncate(self, layer: int, lengths: LengthsLike, *,
                       timeout: Optional[float] = None) -> list[pb.TruncateSequencesResponse]:
        """See pagedattn.ShardedCache.truncate."""
        return await self.client._each("TruncateSequences",
                                       self._truncate_requests(layer, lengths), timeout,
                                       "in TruncateSequences")

    async def refresh(self, *, timeout: Optional[float] = None) -> list[pb.CacheInfo]:
        """See pagedattn.ShardedCache.refresh."""
        infos = await self.client._each("GetCache", self._get_requests(), timeout, "in GetCache")
        self._keep_infos(infos)
        return infos

    async def stats(self, *, timeout: Optional[float] = None) -> list[pb.CacheStats]:
        """See pagedattn.ShardedCache.stats."""
        return [info.stats for info in await self.refresh(timeout=timeout)]

    async def delete(self, *, timeout: Optional[float] = None) -> int:
        """See pagedattn.ShardedCache.delete."""
        return self._deleted(await self.client.fan_out("DeleteCache", self._delete_requests(),
                                                       timeout))

    async def __aenter__(self) -> "ShardedCache":
        return self

    async def __aexit__(self, exc_type: Any, error: Any, tb: Any) -> None:
        if self.delete_on_exit and not self.deleted:
            try:
                await self.delete()
            except Exception as e:
                if exc_type is None:
                    raise
                _common.cleanup_failed_during(
                    error, e, "the sharded cache (its caches left: "
                    + ", ".join(f"{s.cache_id} on {t}" for s, t in zip(self.shards, self.targets)
                                if not s.deleted) + ")")
