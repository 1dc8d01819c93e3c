"""What the sync and asyncio clients share: channel options, TLS credentials, metadata,
building a ForwardRequest / reading a ForwardResponse, and the messages of a Step stream."""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import grpc

from .errors import PagedAttnError, from_status
from .tensors import ArrayLike, DTypeLike, fill_tensor, from_tensor
from .types import (
    SpanLike, cache_id_of, checked_bool, checked_float, checked_int32, span_protos,
)
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


def _pem_of(what: str, x: Union[str, bytes, None], kind: str) -> Optional[bytes]:
    """The PEM bytes of TLS setting `what`, refused when they hold no block of `kind`
    ("CERTIFICATE", "PRIVATE KEY"): gRPC's own error for them names neither the setting nor the
    file."""
    data = _pem(x)
    if data is not None and f"{kind}-----".encode() not in data:
        where = f" ({os.fspath(x)})" if not isinstance(x, bytes) else ""
        raise ValueError(f"TLS {what}{where} holds no PEM {kind} block")
    return data


def receive_limit(opts: Sequence[tuple[str, Any]]) -> Optional[int]:
    """The channel's receive limit among its options (the last one given wins, as in gRPC)."""
    limit = None
    for name, value in opts:
        if name == "grpc.max_receive_message_length":
            limit = value
    return limit


def channel_setup(
    tls: Union[bool, TLS, None], max_message_bytes: int, options: Sequence[tuple[str, Any]]
) -> tuple[Optional[grpc.ChannelCredentials], list[tuple[str, Any]]]:
    """(credentials or None for plaintext, channel options)."""
    max_message_bytes = message_bytes(max_message_bytes)
    extra = channel_options(options)
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A restarted server is called again sooner (gRPC's default backoff grows to 120 s);
        # common/transport.h has the C++ client's same values and what they measured.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    creds = None
    if tls:
        t = tls if isinstance(tls, TLS) else TLS()
        if (t.cert is None) != (t.key is None):
            # gRPC aborts the process on a certificate without its key (or the reverse).
            raise ValueError(
                "TLS: a client certificate and its key go together (got "
                + ("cert without key" if t.key is None else "key without cert") + ")"
            )
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem_of("ca", t.ca, "CERTIFICATE"),
            private_key=_pem_of("key", t.key, "PRIVATE KEY"),
            certificate_chain=_pem_of("cert", t.cert, "CERTIFICATE"),
        )
        if t.server_name:
            opts.append(("grpc.ssl_target_name_override", t.server_name))
    return creds, opts + extra


# gRPC keeps message limits in a C int.
MAX_MESSAGE_BYTES_LIMIT = 2**31 - 1


def message_bytes(value: Any) -> int:
    """max_message_bytes as the int gRPC takes: a whole number of bytes, or -1 for no limit (gRPC
    drops any other value without a word and keeps its own 4 MiB receive limit; a numpy int it
    would misread)."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise TypeError(f"max_message_bytes must be an int, in bytes (got {type(value).__name__} "
                        f"{value!r})")
    if n != -1 and not 1 <= n <= MAX_MESSAGE_BYTES_LIMIT:
        raise ValueError(f"max_message_bytes must be in 1..{MAX_MESSAGE_BYTES_LIMIT}, or -1 for no "
                         f"limit (got {n})")
    return n


def channel_options(options: Any) -> list[tuple[str, Any]]:
    """`options` as a list of (name, value) pairs, refused when it is anything else."""
    example = 'e.g. [("grpc.enable_retries", 0)]'
    if isinstance(options, (str, bytes, dict)) or not isinstance(options, Iterable):
        raise TypeError(f"options must be a list of (name, value) pairs, {example} (got "
                        f"{type(options).__name__})")
    out = []
    for i, pair in enumerate(options):
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not isinstance(pair[0], str)):
            raise TypeError(f"options[{i}] must be a (name, value) pair with a str name, "
                            f"{example} (got {pair!r})")
        out.append((pair[0], pair[1]))
    return out


def check_cache_name(name: Any) -> None:
    """A cache's name: a str (protobuf's own error would not name the argument)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (got {type(name).__name__} {name!r})")


def cleanup_failed_during(error: Optional[BaseException], cleanup: BaseException, what: str) -> None:
    """A context manager's cleanup (deleting `what`) failed while its block raised `error`: the
    block's exception goes on, carrying the cleanup's failure as a note (Python 3.11+), else as
    a warning, so that a cache left behind is named somewhere."""
    note = f"and deleting {what} on leaving the block failed: {cleanup}"
    if error is not None and hasattr(error, "add_note"):
        error.add_note(note)
    else:
        warnings.warn(note, ResourceWarning, stacklevel=3)


def _host_port_error(address: str) -> str:
    """Why address is not host:port, [ipv6]:port or :port with a port in 0..65535 ("" when it
    is), as common/host_port.cc's ParseHostPort says it."""
    if address.startswith("["):
        close = address.find("]")
        if close < 0:
            return "no closing ']'"
        host = address[1:close]
        if address[close + 1:close + 2] != ":":
            return "no :port"
        port = address[close + 2:]
    else:
        host, _, port = address.rpartition(":")
        if ":" in host:
            return "an IPv6 address needs [brackets]"
    if any(c == " " or ord(c) < 32 or ord(c) == 127 for c in host):
        return "the host has a space or a control character"
    if not (0 < len(port) <= 5 and port.isascii() and port.isdigit()):
        return "the port is not a number"
    return "" if int(port) <= 65535 else "the port is out of range"


def check_target(target: Any) -> None:
    """A target grpc would take wrongly, refused when the client is made, as the C++ client
    refuses it: an empty one (a channel that fails every call, UNKNOWN) and a port past 65535
    (grpc connects to it modulo 65536: another port, perhaps another server's)."""
    if not isinstance(target, str):
        raise TypeError(f"target must be a str (got {type(target).__name__})")
    if not target:
        raise ValueError("target is required: host:port, unix:PATH or a gRPC URI")
    host_port, dns = target, target.startswith("dns:")
    if dns:  # dns:host:port, dns:///host:port, dns://authority/host:port
        host_port = target[4:]
        if host_port.startswith("//"):
            host_port = host_port[host_port.find("/", 2) + 1:] if "/" in host_port[2:] else ""
    elif "/" in target or target.startswith(("unix:", "ipv4:", "ipv6:")):
        return
    if ":" not in host_port:  # no port: grpc's default
        return
    why = _host_port_error(host_port)
    if dns and why != "the port is out of range":  # a named port, or none ("[::1]"): grpc's
        return
    if why:
        raise ValueError(f"target {target!r}: {why}")


# Timeouts past this (31 years) are no deadline: grpc's deadline (now plus the timeout, in int64
# nanoseconds) overflows past about 7.4e9 s, and the call then failed at once with
# DEADLINE_EXCEEDED.
NO_DEADLINE_PAST_S = 1e9


def check_timeout(timeout: Any) -> None:
    """A timeout: seconds > 0 (math.inf, or anything past NO_DEADLINE_PAST_S, for no deadline),
    or None (a client's: no deadline; a call's: the client's). Checked when the client is made
    or the call is, not deep inside grpc."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, math.inf for no deadline "
                         f"or None (got {timeout!r})")


def grpc_timeout(default: Optional[float], given: Optional[float]) -> Optional[float]:
    """The timeout a call passes to grpc: given, else the client's default; None for none."""
    timeout = default if given is None else given
    return None if timeout is None or timeout > NO_DEADLINE_PAST_S else timeout


def auth_metadata(token: Optional[str]) -> tuple[tuple[str, str], ...]:
    """The bearer token's metadata, its characters checked when the client is made (grpc would
    fail each call with INTERNAL "Invalid metadata"). The error never quotes the token."""
    if not token:
        return ()
    if not isinstance(token, str):
        raise TypeError(f"token must be a str (got {type(token).__name__})")
    for i, ch in enumerate(token):
        if not ("!" <= ch <= "~"):
            hint = " (a line end, as read from a file: strip it)" if ch in "\r\n" else ""
            raise ValueError(f"token: character {ord(ch):#04x} at position {i} of {len(token)} "
                             f"is not printable ASCII{hint}")
    return (("authorization", f"Bearer {token}"),)


# The longest request id sent (as the C++ client's RequestId::kMaxBytes).
MAX_REQUEST_ID_BYTES = 256

_REQUEST_ID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "pagedattn_request_id", default=None)


@contextlib.contextmanager
def request_id(value: str) -> Iterator[None]:
    """`with pagedattn.request_id("step-41"):` every call made inside (any client, sync or
    asyncio, sharded ones on each shard, and a Step stream opened there) carries `value` as its
    x-request-id metadata; the server puts it on the call's log lines as `req=` (cut to 64 bytes),
    so a failed call can be found in its log. Nests; printable ASCII (gRPC refuses the rest), at
    most 256 characters.
    A context variable: asyncio tasks created inside inherit it, other threads (an executor's)
    do not."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"request_id must be a non-empty str (got {value!r})")
    if len(value) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request_id is {len(value)} characters: at most {MAX_REQUEST_ID_BYTES} "
                         "(the server logs its first 64; headers over 8 KiB reset the whole "
                         "connection, failing its other calls)")
    for i, ch in enumerate(value):
        if not (" " <= ch <= "~"):
            raise ValueError(f"request_id: character {ord(ch):#04x} at position {i} is not "
                             "printable ASCII")
    token = _REQUEST_ID.set(value)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def call_metadata(base: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A call's metadata: the client's (its token) and the request id in force, if any."""
    rid = _REQUEST_ID.get()
    return base if rid is None else base + (("x-request-id", rid),)


def forward_request(
    cache: Any,
    layer: int,
    spans: Sequence[SpanLike],
    q: Optional[ArrayLike],
    k: Optional[ArrayLike],
    v: Optional[ArrayLike],
    causal: Optional[bool],
    sm_scale: Optional[float],
    return_lse: bool,
    dtype: Optional[DTypeLike],
) -> pb.ForwardRequest:
    req = pb.ForwardRequest(cache_id=cache_id_of(cache), layer=checked_int32("layer", layer), spans=span_protos(spans))
    _fill_qkv(req, q, k, v, dtype)
    _fill_options(req, causal, sm_scale, return_lse)
    return req


def _fill_qkv(
    req: pb.ForwardRequest,
    q: Optional[ArrayLike],
    k: Optional[ArrayLike],
    v: Optional[ArrayLike],
    dtype: Optional[DTypeLike],
) -> None:
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (or neither, when no span appends tokens)")
    if q is not None:  # None: no span has queries (an append-only call)
        fill_tensor(req.q, q, dtype, "q")
    if k is not None:
        fill_tensor(req.k, k, dtype, "k")
        fill_tensor(req.v, v, dtype, "v")


def _fill_options(
    req: pb.ForwardRequest, causal: Optional[bool], sm_scale: Optional[float], return_lse: bool
) -> None:
    if causal is not None:
        req.options.causal = checked_bool("causal", causal)
    if sm_scale is not None:
        req.options.sm_scale = checked_float("sm_scale", sm_scale)
    req.options.return_lse = checked_bool("return_lse", return_lse)


def forward_result(resp: pb.ForwardResponse, q: Optional[ArrayLike], return_lse: bool) -> Any:
    out = from_tensor(resp.out, like=q)
    if not return_lse:
        return out
    return out, from_tensor(resp.lse, like=q)


# -- the Step stream -------------------------------------------------------------------------


class Timing(NamedTuple):
    """The server's time for one layer of a Step stream (StepResponse.timing)."""

    server_micros: int  # from the layer starting to run (after its parse and turn) to its encoding
    kernel_micros: int  # time of the layer's kernels (GPU time on the CUDA backend)


def names_no_port(target: str) -> bool:
    """Whether a TCP target leaves its port out ("host", "[::1]", "dns:///host"): gRPC takes 443."""
    if target.startswith("dns:"):
        target = target.rsplit("/", 1)[-1]
    elif "/" in target or target.startswith(("unix:", "ipv4:", "ipv6:")):
        return False
    if target.startswith("["):
        return target.endswith("]")
    return ":" not in target


def call_error(error: PagedAttnError, target: str) -> PagedAttnError:
    """A call's exception; UNAVAILABLE from a target that names no port says where gRPC went (its
    default, 443), as pagedattn-cli's hint does."""
    if error.code == grpc.StatusCode.UNAVAILABLE and names_no_port(target):
        error.message += f" (the target {target!r} names no port: gRPC dials 443; give host:port)"
        error.args = (error.message,)
    return error


def stream_error(error: PagedAttnError, target: str, timeout: Optional[float]) -> PagedAttnError:
    """A Step stream's end (not a layer's error) naming the stream's server, and for a
    deadline, that the stream's timeout covers the whole stream, not each layer."""
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        error.message += (f" (the Step stream to {target}: its deadline, {timeout:g} s, covers the "
                          "whole stream; pass step(timeout=...) or open a new stream)")
    elif error.code == grpc.StatusCode.UNAVAILABLE:
        error.message += f" (the Step stream to {target})"
    else:
        return error
    error.args = (error.message,)
    return error


class StepMessages:
    """Builds the messages of one Step stream, as the server reads them: a message that sets
    spans opens a step (with its cache_id and options); the messages after it carry only a
    layer and its q/k/v and run with the open step's spans, cache and options."""

    def __init__(self) -> None:
        self._opening: Optional[pb.ForwardRequest] = None  # spans/options for the next message
        self.return_lse = False  # of the open step (or the one the next message opens)
        self.dtype: Optional[DTypeLike] = None

    def begin(
        self,
        cache: Any,
        spans: Sequence[SpanLike],
        causal: Optional[bool],
        sm_scale: Optional[float],
        return_lse: bool,
        dtype: Optional[DTypeLike],
    ) -> None:
        """The next message opens a step with these spans and options (defaults when unset)
        on `cache` (None: the stream's cache)."""
        opening = pb.ForwardRequest(spans=span_protos(spans))
        if not opening.spans:
            raise ValueError("a step needs at least one span")
        if cache is not None:
            opening.cache_id = cache_id_of(cache)
        elif self._opening is not None:  # the stream's first message is still to go out
            opening.cache_id = self._opening.cache_id
        _fill_options(opening, causal, sm_scale, return_lse)
        self._opening = opening
        self.return_lse = return_lse
        self.dtype = dtype

    def request(
        self, layer: int, q: Optional[ArrayLike], k: Optional[ArrayLike], v: Optional[ArrayLike]
    ) -> pb.ForwardRequest:
        """The message for `layer`: the opening one (spans, cache_id, options) after begin(),
        else only the layer and its tensors. Call sent() once it is on its way."""
        req = pb.ForwardRequest(layer=checked_int32("layer", layer))
        _fill_qkv(req, q, k, v, self.dtype)
        if self._opening is not None:
            req.MergeFrom(self._opening)
        return req

    def sent(self) -> None:
        self._opening = None


_UNSET = object()


class LayerAnswer:
    """What the sync and asyncio LayerFutures share: the answer to one layer of a Step stream
    once read, decoded (once) as forward() returns it."""

    def __init__(self, layer: int, like: ArrayLike, return_lse: bool) -> None:
        self.layer = layer
        self.timing: Optional[Timing] = None  # the server's time, once answered
        self._like: Any = like  # the result is the same kind of array as q
        self._return_lse = return_lse
        self._response: Optional[pb.StepResponse] = None
        self._failed: Optional[Exception] = None  # the stream's failure, not the layer's
        self._value: Any = _UNSET
        self._error: Optional[Exception] = None  # the layer's own error (StepResponse.error)

    def done(self) -> bool:
        """True once the answer (or the stream's failure) is here: result() will not wait."""
        return self._response is not None or self._failed is not None

    def _answer(self, resp: pb.StepResponse) -> None:
        self.timing = Timing(resp.timing.server_micros, resp.timing.kernel_micros)
        self._response = resp

    def _outcome(self) -> Any:
        """The value, or raises the stream's failure or the layer's error (once done)."""
        if self._failed is not None:
            raise self._failed
        if self._value is _UNSET and self._error is None:
            assert self._response is not None
            resp = self._response
            if resp.HasField("error") and resp.error.code != 0:
                # What forward() raises for the same google.rpc.Status.
                self._error = from_status(resp.error)
            else:
                self._value = forward_result(resp, self._like, self._return_lse)
            self._response = pb.StepResponse()  # decoded: the bytes are not kept twice
            self._like = None
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"{type(self).__name__}(layer={self.layer}, {state})"
