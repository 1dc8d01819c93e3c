"""pagedattn.Client: the blocking client of pagedattn.v1.AttentionService. Thread-safe: one
Client (one gRPC channel) can serve any number of threads at once."""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

import grpc

from . import _common, device
from ._common import TLS, Timing
from ._vendor.grpc.health.v1 import health_pb2, health_pb2_grpc
from .errors import ClientClosed, NotFound, PagedAttnError, from_rpc_error
from .tensors import ArrayLike, DTypeLike
from .types import (
    ConfigLike,
    LengthsLike,
    SpanLike,
    cache_id_of,
    checked_int32,
    config_proto,
    seq_id_list,
    sequence_lengths,
    span_protos,
)
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc


class Client:
    """A connection to a pagedattn server.

    Args:
        target: "host:port" of the server.
        token: bearer token sent as `authorization: Bearer <token>` (servers with --auth_tokens_file).
        tls: False for plaintext, True for TLS with the system roots, or a `pagedattn.TLS`.
        timeout: default per-call deadline in seconds (None, math.inf or anything past 1e9 s:
            no deadline; a call passes its own timeout=, math.inf for none).
        max_message_bytes: send/receive limit; defaults to the server's own maximum (512 MiB)
            instead of gRPC's 4 MiB receive limit.
        options: extra gRPC channel options, e.g. [("grpc.enable_retries", 0)].

    A call that fails raises a pagedattn.errors exception (PagedAttnError and its subclasses:
    InvalidArgument for a request the server refused, Unavailable, ...). An argument the client
    checks itself before sending anything (a dtype, k without v, a name that is not a str, the
    arguments above) raises TypeError or ValueError naming it; a Step used after it closed
    raises RuntimeError.
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
            self.channel = grpc.insecure_channel(target, options=opts)
        else:
            self.channel = grpc.secure_channel(target, creds, options=opts)
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._closed = False
        # Closes the channel when the client is collected, and at interpreter exit if it is
        # still open: an open Step stream's call left to the garbage collector at exit can hang
        # grpc's own finalizer.
        self._close_channel = weakref.finalize(self, self.channel.close)

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, method: Callable, request: Any, timeout: Optional[float]) -> Any:
        self._check_open()
        if timeout is not None:
            _common.check_timeout(timeout)
        try:
            return method(
                request,
                timeout=_common.grpc_timeout(self.timeout, timeout),
                metadata=_common.call_metadata(self._metadata),
            )
        except grpc.RpcError as e:
            raise _common.call_error(from_rpc_error(e), self.target) from e

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this client of {self.target} is closed (close() or the end of "
                               "its `with` block); make a new Client")

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled, later calls raise ClientClosed."""
        self._closed = True
        self._close_channel()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the API -------------------------------------------------------------------------------

    def server_info(self, *, timeout: Optional[float] = None) -> pb.ServerInfo:
        """Version, backend ("cuda"/"cpu"), device, memory, the capability table and the
        server's limits (ServerInfo.limits)."""
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
        _common.check_cache_name(name)
        req = pb.CreateCacheRequest(config=config_proto(config), name=name)
        info = self._call(self.stub.CreateCache, req, timeout)
        return Cache(self, info, delete_on_exit=delete_on_exit)

    def get_cache(self, cache: Any, *, timeout: Optional[float] = None) -> pb.CacheInfo:
        """Config and live stats (free/used pages, live sequences, Forward calls) of a cache."""
        return self._call(self.stub.GetCache, pb.GetCacheRequest(cache_id=cache_id_of(cache)), timeout)

    def list_caches(
        self, *, page_size: int = 0, timeout: Optional[float] = None
    ) -> list[pb.CacheInfo]:
        """Every cache of this server (of the caller's tenant when auth is on), oldest first:
        every page, page_size caches a call (0: as many as fit 4 MiB)."""
        caches: list[pb.CacheInfo] = []
        req = pb.ListCachesRequest(page_size=checked_int32("page_size", page_size))
        while True:
            resp = self._call(self.stub.ListCaches, req, timeout)
            caches.extend(resp.caches)
            if not resp.next_page_token:
                return caches
            req.page_token = resp.next_page_token

    def delete_cache(self, cache: Any, *, timeout: Optional[float] = None) -> int:
        """Frees a cache; returns the bytes given back. In-flight Forwards on it finish first."""
        req = pb.DeleteCacheRequest(cache_id=cache_id_of(cache))
        return self._call(self.stub.DeleteCache, req, timeout).freed_bytes

    def forward(
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
        """Appends each span's new K/V to `layer` of the cache, then attends its queries.

        Args:
            cache: a Cache, a CacheInfo or a cache id.
            spans: Span / (seq_id, start, num_new_tokens, num_queries) per sequence, in the
                order of the rows of q and k/v.
            q: [total_queries, num_q_heads, head_dim], float32/float16/bfloat16 numpy array or
                torch tensor (float64 travels as float32; CUDA tensors through host memory);
                None when no span has queries (out then comes back empty, as numpy).
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

    def register_memory(
        self, cache: Any, buffer: Any, *, lease_seconds: int = 0, timeout: Optional[float] = None
    ) -> device.DeviceMemory:
        """Maps the GPU allocation holding torch CUDA tensor `buffer` into the server (CUDA
        IPC; a CUDA server on this node) for the cache's forward_device() calls. lease_seconds:
        released after this long unused (0: the server's default)."""
        req, base, keep = device.register_request(cache_id_of(cache), buffer, lease_seconds)
        return device.DeviceMemory(self, self._call(self.stub.RegisterMemory, req, timeout), base,
                                   keep)

    def unregister_memory(self, region_id: str, *, timeout: Optional[float] = None) -> None:
        self._call(self.stub.UnregisterMemory, pb.UnregisterMemoryRequest(region_id=region_id),
                   timeout)

    def forward_device(
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
        """forward() on torch CUDA tensors in registered memory: the server reads q/k/v and
        writes out (q's shape and dtype) and lse ([total_queries, num_q_heads] float32: asks
        for it) in place. Synchronize first (torch.cuda.synchronize() or the writing stream):
        the server reads q/k/v when the call arrives; out is written when this returns."""
        req = device.device_request(memory, cache_id_of(cache), layer, span_protos(spans), q, k,
                                    v, out, lse, causal, sm_scale)
        self._call(self.stub.Forward, req, timeout)

    def release(
        self, cache: Any, seq_ids: Sequence[int], *, timeout: Optional[float] = None
    ) -> pb.ReleaseSequencesResponse:
        """Frees the sequences' pages in every layer: `released`, `freed_pages`, and the
        `unknown_seq_ids` that had no sequence (not an error)."""
        req = pb.ReleaseSequencesRequest(cache_id=cache_id_of(cache), seq_ids=seq_id_list(seq_ids))
        return self._call(self.stub.ReleaseSequences, req, timeout)

    def truncate(
        self, cache: Any, layer: int, lengths: LengthsLike, *, timeout: Optional[float] = None
    ) -> pb.TruncateSequencesResponse:
        """Rewinds sequences in one layer to shorter lengths ({seq_id: length} or (seq_id,
        length) pairs), as a forward() writing at `length` would before it writes: undoes
        appends (rejected speculative tokens, a sharded forward that failed elsewhere). A
        sequence already that short is left as is; one left with no token in any layer is
        freed. All or nothing. Returns `truncated`, `freed_pages` and `unknown_seq_ids` (not
        an error)."""
        req = pb.TruncateSequencesRequest(
            cache_id=cache_id_of(cache), layer=checked_int32("layer", layer), lengths=sequence_lengths(lengths)
        )
        return self._call(self.stub.TruncateSequences, req, timeout)

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
        """Opens a Step stream: every layer of a step (e.g. one decode step of a model) on one
        bidirectional stream, each layer exactly a forward() with these spans and options.

        The first message sends `cache`, `spans` and the options; each later one only a layer
        and its q/k/v. `step.forward(layer, q, k, v)` sends a layer and waits for its answer;
        `step.submit(...)` sends it and returns a LayerFuture, so that every layer can be sent
        before the first answer is read (answers come in the order sent). A layer's error
        raises what forward() would raise, from its result(); the stream goes on.

        `with client.step(cache, spans) as step:` closes the stream on exit (cancels it when
        the block raises). `timeout` (default: the client's) is the deadline of the whole
        stream. Arguments as forward()."""
        _common.check_timeout(timeout)
        return Step(self, cache, spans, causal=causal, sm_scale=sm_scale, return_lse=return_lse,
                    dtype=dtype, timeout=self.timeout if timeout is None else timeout)


_END = object()  # ends the request iterator: the stream is half-closed


class LayerFuture(_common.LayerAnswer):
    """The answer to one layer sent on a Step stream (Step.submit): `layer`, `timing` (the
    server's time, a Timing, once answered), done() and result()."""

    def __init__(self, step: "Step", layer: int, like: Any, return_lse: bool) -> None:
        super().__init__(layer, like, return_lse)
        self._step = step

    def result(self) -> Any:
        """Waits for this layer's answer, reading the stream's answers up to it, and returns it
        as Client.forward() does (out, or (out, lse)). Raises the layer's error as forward()
        would (the stream goes on), or the stream's failure (e.g. DeadlineExceeded; a
        cancelled stream: PagedAttnError with code CANCELLED)."""
        self._step._wait(self)
        if self._failed is not None:
            self._step._error_seen = True
        return self._outcome()


class Step:
    """A Step stream (Client.step): layers of the open step go out as they are submitted and
    their answers come back in the same order. Thread-safe: one thread may submit while
    another waits for results. Not reusable once closed."""

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
        self._messages = _common.StepMessages()
        self._messages.begin(cache, spans, causal, sm_scale, return_lse, dtype)
        self._pending: deque[LayerFuture] = deque()  # sent, not answered, in order
        self._lock = threading.Lock()  # the order of sending and _pending; the state below
        self._read_lock = threading.Lock()  # one reader of the stream at a time
        self._closed = False  # no more messages (close() or cancel())
        self._cancelled = False
        self._finished = False  # the stream ended well (every answer read)
        self._failure: Optional[PagedAttnError] = None  # what ended the stream otherwise
        self._error_seen = False  # the failure was raised to the caller
        self._requests: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._timeout = timeout
        client._check_open()
        self._call = client.stub.Step(
            iter(self._requests.get, _END), timeout=_common.grpc_timeout(timeout, None),
            metadata=_common.call_metadata(client._metadata),
        )
        # A stream that ended (its deadline, its client's close(), the server) ends the request
        # iterator too: else grpc's thread sending it stays blocked until the Step is collected.
        requests = self._requests  # not self: the call must not keep the Step alive
        self._call.add_done_callback(lambda _: requests.put(_END))

    # -- sending -------------------------------------------------------------------------------

    def begin(
        self,
        spans: Sequence[SpanLike],
        *,
        cache: Any = None,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        return_lse: bool = False,
    ) -> None:
        """Opens the next step (or micro-batch) on this stream: the next message sends these
        spans and options (defaults when unset, as in Client.step) and `cache` (by default the
        stream's); the layers after it run with them."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the Step stream is closed")
            # The stream's cache named again: a message the server could not parse (more spans
            # than its --max_forward_spans) made it forget the stream's.
            self._messages.begin(self.cache_id if cache is None else cache, spans, causal,
                                 sm_scale, return_lse, self._messages.dtype)
            if cache is not None:
                self.cache_id = cache_id_of(cache)

    def submit(
        self, layer: int, q: Optional[ArrayLike], k: Optional[ArrayLike] = None,
        v: Optional[ArrayLike] = None,
    ) -> LayerFuture:
        """Sends `layer` of the open step (q, k, v as in Client.forward) without waiting for
        its answer; its result() waits. Raises RuntimeError once the stream is closed, and
        the stream's failure once it is known."""
        self.client._check_open()  # a closed client's stream sends nothing more
        with self._lock:
            if self._failure is not None:
                self._error_seen = True
                raise self._failure
            if self._closed:
                raise RuntimeError("the Step stream is closed")
            request = self._messages.request(layer, q, k, v)
            future = LayerFuture(self, layer, q, self._messages.return_lse)
            self._pending.append(future)
            self._requests.put(request)
            self._messages.sent()
        return future

    def forward(
        self, layer: int, q: Optional[ArrayLike], k: Optional[ArrayLike] = None,
        v: Optional[ArrayLike] = None,
    ) -> Any:
        """submit(layer, q, k, v).result(): sends the layer and waits for its answer, which is
        what Client.forward would return for it (its error too)."""
        return self.submit(layer, q, k, v).result()

    # -- ending --------------------------------------------------------------------------------

    def close(self) -> None:
        """Half-closes the stream (no more messages), reads the answers still due (their
        futures keep them) and the stream's end. Raises the stream's failure (not a layer's
        error) when no result() or submit() has raised it yet. Idempotent."""
        with self._lock:
            already = self._closed
            self._closed = True
        if not already:
            self._requests.put(_END)
        with self._read_lock:
            while self._failure is None and self._pending:
                self._read_one()
            if self._failure is None and not self._finished:
                try:
                    next(self._call)
                except StopIteration:
                    self._finished = True
                except grpc.RpcError as e:
                    self._fail(self._stream_error(e))
                else:
                    self._fail(PagedAttnError("the Step stream answered a message never sent",
                                              grpc.StatusCode.INTERNAL))
        if self._failure is not None and not self._error_seen:
            self._error_seen = True
            raise self._failure

    def cancel(self) -> None:
        """Cancels the stream. Layers the server completed stay committed, none partially;
        the futures not answered yet raise PagedAttnError (code CANCELLED), whether or not
        the server completed them."""
        with self._lock:
            if self._finished or self._failure is not None:
                return
            self._closed = self._cancelled = True
        self._call.cancel()
        self._fail(PagedAttnError("the Step stream was cancelled", grpc.StatusCode.CANCELLED))
        self._error_seen = True

    @property
    def closed(self) -> bool:
        """True once close() or cancel() was called, the stream failed or its client closed."""
        return self._closed or self._failure is not None or self.client._closed

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()

    def __del__(self) -> None:
        try:
            if not self._finished and self._failure is None:
                self.cancel()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"Step(cache_id={self.cache_id!r}, pending={len(self._pending)})"

    # -- reading -------------------------------------------------------------------------------

    def _wait(self, future: LayerFuture) -> None:
        while not future.done():
            with self._read_lock:
                if not future.done():
                    self._read_one()

    def _read_one(self) -> None:
        """Reads the next answer into the oldest pending future (or fails the stream)."""
        try:
            resp = next(self._call)
        except StopIteration:
            self._fail(PagedAttnError("the Step stream ended before answering every message",
                                      grpc.StatusCode.INTERNAL))
            return
        except grpc.RpcError as e:
            self._fail(self._stream_error(e))
            return
        with self._lock:
            future = self._pending.popleft() if self._pending else None
        if future is None:
            self._fail(PagedAttnError("the Step stream answered a message never sent",
                                      grpc.StatusCode.INTERNAL))
            return
        future._answer(resp)
        self.last_timing = future.timing

    def _stream_error(self, e: grpc.RpcError) -> PagedAttnError:
        return _common.stream_error(from_rpc_error(e), self.client.target, self._timeout)

    def _fail(self, error: PagedAttnError) -> None:
        """The stream is over: every pending future gets `error` (the first failure wins)."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
        self._requests.put(_END)  # the request iterator's thread ends
        for future in pending:
            future._failed = self._failure


class Cache:
    """A handle on one server-side cache: its `cache_id`, the CacheInfo from creation (`info`),
    and forward/release/refresh/delete bound to it. A context manager: deletes the cache on
    exit when created with delete_on_exit=True (the default); one gone already (NOT_FOUND: its
    server restarted, say) counts as deleted."""

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

    def forward(self, layer: int, spans: Sequence[SpanLike], q: Optional[ArrayLike], k: Any = None,
                v: Any = None, **kwargs: Any) -> Any:
        """Client.forward on this cache."""
        return self.client.forward(self, layer, spans, q, k, v, **kwargs)

    def step(self, spans: Sequence[SpanLike], **kwargs: Any) -> Step:
        """Client.step on this cache."""
        return self.client.step(self, spans, **kwargs)

    def release(self, seq_ids: Sequence[int], **kwargs: Any) -> pb.ReleaseSequencesResponse:
        """Client.release on this cache."""
        return self.client.release(self, seq_ids, **kwargs)

    def truncate(self, layer: int, lengths: LengthsLike,
                 **kwargs: Any) -> pb.TruncateSequencesResponse:
        """Client.truncate on this cache."""
        return self.client.truncate(self, layer, lengths, **kwargs)

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

    def __exit__(self, exc_type: Any, error: Any, tb: Any) -> None:
        if self.delete_on_exit and not self.deleted:
            try:
                self.delete()
            except NotFound:  # gone already: nothing is left behind
                self.deleted = True
            except Exception as e:
                if exc_type is None:
                    raise
                # The block's own exception goes on, noting the cache it leaves behind.
                _common.cleanup_failed_during(error, e, f"the cache {self.cache_id}")

    def __repr__(self) -> str:
        return f"Cache(cache_id={self.cache_id!r}, name={self.info.name!r})"
