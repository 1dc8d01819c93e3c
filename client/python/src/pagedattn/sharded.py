"""pagedattn.ShardedClient / ShardedCache: one logical KV cache split by KV head across several
servers. Attention is independent per KV head, so shard i of N holds KV heads
[i*kv/N, (i+1)*kv/N) and the query heads that read them, [i*q/N, (i+1)*q/N) (a contiguous
split keeps each GQA group with its KV head). A forward() sends every shard its heads of q, k
and v at once and joins the answers along the head axis: the result is what one server holding
the whole cache would return (bit for bit on the CPU backend; on CUDA up to rounding, since a
launch with fewer heads may split a sequence's KV over more blocks).

    with pagedattn.ShardedClient(["10.0.0.1:50051", "10.0.0.2:50051"]) as client:
        with client.create_cache(config) as cache:    # one cache per server, deleted on exit
            out = cache.forward(0, [Span.prefill(1, 5)], q, k, v)

A forward that fails on some shards is rolled back on every shard (TruncateSequences to each
appending span's start), then raises what the failed shard raised (the same class, e.g.
OutOfPages) with the shard named; see ShardedCache.forward. pagedattn.aio has the asyncio twin.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any, Optional, Sequence, Union

import grpc

from . import _common
from ._common import TLS
from .client import Cache, Client
from .errors import (
    CacheConfigError, ClientClosed, InvalidArgument, NotFound, PagedAttnError, from_rpc_error,
)
from .tensors import ArrayLike, DTypeLike, _is_torch
from .types import (
    ConfigLike, LengthsLike, SpanLike, checked_int32, config_proto, seq_id_list, sequence_lengths,
    span_protos,
)
from .v1 import attention_pb2 as pb

TargetsLike = Union[str, Sequence[Union[str, Any]]]

# -- targets ---------------------------------------------------------------------------------


def _split_host_port(name: str, port: Optional[int]) -> tuple[str, int]:
    if port is not None:
        return name.strip("[]"), int(port)
    if name.startswith("["):  # [v6]:port
        host, sep, rest = name[1:].partition("]:")
        if sep and rest.isdigit():
            return host, int(rest)
    else:
        host, sep, rest = name.rpartition(":")
        if sep and rest.isdigit() and ":" not in host:
            return host, int(rest)
    raise ValueError(f"give the port: {name!r} is not host:port (or pass port=)")


def targets_from_dns(name: str, port: Optional[int] = None) -> list[str]:
    """The "host:port" target of every address that `name` resolves to (its A and AAAA
    records, e.g. a Kubernetes headless Service), each once, sorted (IPv4 before IPv6, each
    numerically) so that every client numbers the shards alike. `name` may carry the port
    ("pagedattn.ns.svc.cluster.local:50051") when `port` is not given. Raises socket.gaierror
    when the name does not resolve."""
    host, port = _split_host_port(name, port)
    addresses = {}  # the address (for its order) -> its text as resolved
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if family in (socket.AF_INET, socket.AF_INET6):
            addresses[ipaddress.ip_address(sockaddr[0].split("%", 1)[0])] = sockaddr[0]
    ordered = sorted(addresses, key=lambda a: (a.version, int(a)))
    return [f"{addresses[a]}:{port}" if a.version == 4 else f"[{addresses[a]}]:{port}"
            for a in ordered]


def resolve_targets(targets: TargetsLike) -> list[Any]:
    """A list of targets (or Clients) as given; one string: the addresses it resolves to."""
    if isinstance(targets, str):
        resolved = targets_from_dns(targets)
        if not resolved:
            raise ValueError(f"{targets!r} resolves to no IPv4 or IPv6 address")
        return resolved
    out = list(targets)
    if not out:
        raise ValueError("a sharded client needs at least one target")
    return out


def shard_name(shard: int, target: str) -> str:
    return f"shard {shard} ({target})"


# -- the split -------------------------------------------------------------------------------


def head_range(num_heads: int, num_shards: int, shard: int) -> range:
    """The heads of `shard`: [shard*num_heads/num_shards, (shard+1)*num_heads/num_shards)."""
    per = num_heads // num_shards
    return range(shard * per, (shard + 1) * per)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_configs(config: ConfigLike, num_shards: int) -> list[pb.CacheConfig]:
    """Each shard's CacheConfig: 1/num_shards of the heads (and of max_bytes, so that a shard
    gets the pages the whole cache would), the rest as given. Raises CacheConfigError when the
    heads do not split (num_kv_heads not divisible by num_shards, num_q_heads not a multiple of
    num_kv_heads): nothing is sent to a server then."""
    full = config_proto(config)
    n = num_shards
    kv, q = full.num_kv_heads, full.num_q_heads
    violations: list[tuple[str, str]] = []
    if kv < 1 or kv % n:
        valid = ", ".join(map(str, _divisors(kv))) if kv >= 1 else "none"
        violations.append(("num_kv_heads", (
            f"num_kv_heads must be divisible by the number of shards, {n}, to split the KV heads "
            f"evenly (got {kv}; shard counts that divide it: {valid})")))
    if kv >= 1 and (q < 1 or q % kv):
        violations.append(("num_q_heads", (
            f"num_q_heads must be a positive multiple of num_kv_heads={kv}, so that each query "
            f"head stays on the shard of its KV head (got {q})")))
    for i, layer in enumerate(full.layers):  # split by q head below: the whole count here
        if layer.sinks and len(layer.sinks) != q:
            violations.append((f"layers[{i}].sinks", (
                f"sinks must have num_q_heads={q} values, one per q head (got "
                f"{len(layer.sinks)})")))
    if violations:
        what = "; ".join(f"{field}: {why}" for field, why in violations)
        plural = "s" if len(violations) > 1 else ""
        raise CacheConfigError(
            f"invalid cache config for {n} shards ({len(violations)} violation{plural}): {what}",
            grpc.StatusCode.INVALID_ARGUMENT, None, violations)
    out = []
    for i in range(n):
        c = pb.CacheConfig()
        c.CopyFrom(full)
        c.num_q_heads = q // n
        c.num_kv_heads = kv // n
        if full.WhichOneof("capacity") == "max_bytes":
            c.max_bytes = full.max_bytes // n
        for layer in c.layers:  # sinks are per q head: the shard's heads' own
            if layer.sinks:
                heads = head_range(q, n, i)
                sinks = list(layer.sinks)[heads.start:heads.stop]
                del layer.sinks[:]
                layer.sinks.extend(sinks)
        out.append(c)
    return out


def validation_error(
    responses: Sequence[Any], targets: Sequence[str]
) -> Optional[Exception]:
    """The error for shard validations (ValidateCacheConfigResponse, or the exception of a
    failed call, by shard): a CacheConfigError whose violations name their shard (its
    description starts "shard i (target): "), or the first failed call's exception naming its
    shard; None when every shard accepts its config."""
    failed = [(i, r) for i, r in enumerate(responses) if isinstance(r, BaseException)]
    if failed:
        return shard_error(failed, targets, len(targets), "validating the cache config")
    invalid = [i for i, r in enumerate(responses) if not r.valid]
    if not invalid:
        return None
    def described(v: Any) -> str:
        # A shard's server judges its part of max_bytes (1/N of the whole cache's): the values
        # it names are a shard's, said beside them, or the suggestion fails again.
        if v.field != "max_bytes" or len(targets) == 1:
            return v.description
        n = len(targets)
        return (f"{v.description} (the values are a shard's: each takes 1/{n} of the cache's "
                f"max_bytes, so the cache's are {n} times them)")

    violations = [
        (v.field, f"{shard_name(i, targets[i])}: {described(v)}")
        for i in invalid for v in responses[i].violations
    ]
    # The message says each violation once, with the shards that have it.
    grouped: dict[tuple[str, str], list[int]] = {}
    for i in invalid:
        for v in responses[i].violations:
            grouped.setdefault((v.field, described(v)), []).append(i)
    what = "; ".join(
        f"{field}: shard{'s' if len(shards) > 1 else ''} "
        + ", ".join(f"{i} ({targets[i]})" for i in shards) + f": {why}"
        for (field, why), shards in grouped.items())
    where = (f"shard{'s' if len(invalid) > 1 else ''} "
             + ", ".join(f"{i} ({targets[i]})" for i in invalid))
    plural = "s" if len(violations) > 1 else ""
    err = CacheConfigError(
        f"invalid cache config on {where} of {len(targets)} "
        f"({len(violations)} violation{plural}): {what}",
        grpc.StatusCode.INVALID_ARGUMENT, None, violations)
    err.shard, err.target = invalid[0], targets[invalid[0]]
    err.shards = invalid
    return err


def _check_shape(x: Any, name: str, want: list[int], names: str) -> None:
    """The whole cache's shape, checked before the split: a shard's server would name its own
    part's (its heads only)."""
    shape = [int(d) for d in x.shape]
    if shape != want:
        raise InvalidArgument(f"{name}.shape must be {want} = [{names}] (got {shape})",
                              grpc.StatusCode.INVALID_ARGUMENT)


def _as_array(x: Any) -> Any:
    if x is None or _is_torch(x):
        return x
    import numpy as np

    return np.asarray(x)


def split_heads(
    q: Optional[ArrayLike], k: Optional[ArrayLike], v: Optional[ArrayLike], config: pb.CacheConfig,
    spans: Sequence[pb.Span], num_shards: int,
) -> list[tuple[Any, Any, Any]]:
    """(q, k, v) of each shard: views of its heads (dtypes kept; the request copies them).
    Their shapes are checked first, against the whole cache's `config` and the spans."""
    q, k, v = _as_array(q), _as_array(k), _as_array(v)
    num_q_heads, num_kv_heads, d = config.num_q_heads, config.num_kv_heads, config.head_dim
    if q is not None:  # None: no span has queries
        _check_shape(q, "q", [sum(s.num_queries for s in spans), num_q_heads, d],
                     "total_queries, num_q_heads, head_dim")
    new_tokens = sum(s.num_new_tokens for s in spans)
    for name, x in (("k", k), ("v", v)):
        if x is not None:
            _check_shape(x, name, [new_tokens, num_kv_heads, d],
                         "total_new_tokens, num_kv_heads, head_dim")
    parts = []
    for i in range(num_shards):
        qh = head_range(num_q_heads, num_shards, i)
        kh = head_range(num_kv_heads, num_shards, i)
        qs = None if q is None else q[:, qh.start:qh.stop]
        ks = None if k is None else k[:, kh.start:kh.stop]
        vs = None if v is None else v[:, kh.start:kh.stop]
        parts.append((qs, ks, vs))
    return parts


def _concat(parts: list[Any]) -> Any:
    if _is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=1)
    import numpy as np

    return np.concatenate(parts, axis=1)


def join_results(results: Sequence[Any], return_lse: bool) -> Any:
    """Each shard's forward() result joined along the head axis."""
    if not return_lse:
        return _concat(list(results))
    return _concat([r[0] for r in results]), _concat([r[1] for r in results])


# -- failures --------------------------------------------------------------------------------

# Codes a server answers before it writes anything (a Forward is all or nothing): a shard that
# failed with one of them holds nothing of the call. Others (UNAVAILABLE, DEADLINE_EXCEEDED,
# CANCELLED, INTERNAL, UNKNOWN, RESOURCE_EXHAUSTED of the transport) may come after it wrote.
_NOTHING_WRITTEN = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}


_RECEIVE_LIMIT = re.compile(r"Received message larger than max \(\d+ vs\. (\d+)\)")


def nothing_written(error: BaseException, receive_limit: Optional[int] = None) -> bool:
    """True when a shard's failed Forward certainly wrote nothing. receive_limit: the shard's
    client's own (gRPC's "Received message larger than max" with another limit is the
    server's refusal of the request; with this one, an answer the client refused: committed)."""
    if isinstance(error, ClientClosed) or isinstance(error, (TypeError, ValueError)):
        return True  # refused by the client before a call began
    if not isinstance(error, PagedAttnError):
        return False
    if error.code in _NOTHING_WRITTEN:
        return True
    # gRPC's own limit on a message that this client would send: it never left.
    if (error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "Sent message larger than max" in error.message):
        return True
    received = _RECEIVE_LIMIT.search(error.message or "")
    if (error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and received is not None
            and receive_limit is not None and int(received.group(1)) != receive_limit):
        return True
    # The server's RESOURCE_EXHAUSTED (out of pages, busy, ...) carries a google.rpc.ErrorInfo.
    return error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and bool(getattr(error, "reason", None))


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _renamed(error: BaseException, message: str) -> BaseException:
    """A copy of `error` (its class and attributes) with `message`."""
    cls = type(error)
    try:
        new = cls.__new__(cls, message)
        new.__dict__.update(getattr(error, "__dict__", {}))
        new.args = (message,)
    except Exception:  # an exception class that cannot be copied so
        code = getattr(error, "code", None)
        new = PagedAttnError(f"{type(error).__name__}: {message}",
                             code if isinstance(code, grpc.StatusCode) else None)
    if isinstance(new, PagedAttnError):
        new.message = message
    return new


def shard_error(
    failed: Sequence[tuple[int, BaseException]],
    targets: Sequence[str],
    num_shards: int,
    doing: str,
    *,
    after: str = "",
    rollback_errors: Optional[dict[int, BaseException]] = None,
    rolled_back: Optional[list[int]] = None,
) -> BaseException:
    """The exception for shards that failed: the first one's exception (its class and
    attributes, e.g. OutOfPages with its numbers) with the shard named in its message, the
    others mentioned, and `after` appended. Attributes added: shard (index), target,
    shard_errors ({index: exception} of every failed shard), rolled_back, rollback_errors, and
    original (the first shard's own exception, also the __cause__ when raised with `from`)."""
    first, error = failed[0]
    base = error.message if isinstance(error, PagedAttnError) else _describe(error)
    same = [i for i, e in failed if _describe(e) == _describe(error)]  # the same error
    where = ", ".join(f"{i} ({targets[i]})" for i in same)
    message = (f"shard{'s' if len(same) > 1 else ''} {where} of {num_shards} failed {doing}: "
               f"{base}")
    for i, other in failed:
        if i not in same:
            message += f"; {shard_name(i, targets[i])} failed too: {_describe(other)}"
    message += after
    new = _renamed(error, message)
    new.shard = first
    new.target = targets[first]
    new.shard_errors = dict(failed)
    new.rolled_back = list(rolled_back or [])
    new.rollback_errors = dict(rollback_errors or {})
    new.original = error
    return new


def rollback_lengths(spans: Sequence[pb.Span]) -> list[tuple[int, int]]:
    """(seq_id, start) of each span that writes: TruncateSequences to them undoes the call."""
    return [(s.seq_id, s.start) for s in spans if s.num_new_tokens > 0]


def forward_failure(
    outcomes: Sequence[Any],
    targets: Sequence[str],
    rollback: Optional[Sequence[Any]],
) -> BaseException:
    """The exception of a sharded forward that failed on some shards. `outcomes`: each shard's
    answer or exception; `rollback`: each shard's TruncateSequences answer or exception (None
    where not sent), or None when no rollback was needed."""
    n = len(targets)
    failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    rolled_back: list[int] = []
    rollback_errors: dict[int, BaseException] = {}
    if rollback is None:
        after = "; no shard wrote anything"
    else:
        for i, r in enumerate(rollback):
            if isinstance(r, BaseException):
                rollback_errors[i] = r
            elif r is not None:
                rolled_back.append(i)
        after = ""
        if rolled_back:
            after += ("; rolled back (TruncateSequences to each span's start) on shard"
                      f"{'s' if len(rolled_back) > 1 else ''} "
                      + ", ".join(map(str, rolled_back)))
        for i, e in rollback_errors.items():
            after += f"; could NOT roll back {shard_name(i, targets[i])}: {_describe(e)} " + (
                "(its cache is gone, e.g. its server restarted: this sharded cache cannot "
                "serve any more; delete it and create it again)" if isinstance(e, NotFound) else
                "(its cache may keep this call's tokens: release those sequences or retry the "
                "call, which rewrites them)")
    return shard_error(failed, targets, n, "in Forward", after=after,
                       rollback_errors=rollback_errors, rolled_back=rolled_back)


def first_failure(
    outcomes: Sequence[Any], targets: Sequence[str], doing: str
) -> Optional[BaseException]:
    """shard_error for the failed calls of a fan-out, or None when every shard answered."""
    failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    return shard_error(failed, targets, len(targets), doing) if failed else None


def full_config(shard_infos: Sequence[pb.CacheInfo]) -> pb.CacheConfig:
    """The whole cache's config: shard 0's resolved one with every head, and the pages of the
    smallest shard (every shard holds every sequence's pages for its heads)."""
    n = len(shard_infos)
    c = pb.CacheConfig()
    c.CopyFrom(shard_infos[0].config)
    c.num_q_heads *= n
    c.num_kv_heads *= n
    c.num_pages = min(info.num_pages for info in shard_infos)
    for i, layer in enumerate(c.layers):  # every shard's sinks, in head order
        if layer.sinks:
            del layer.sinks[:]
            for info in shard_infos:
                layer.sinks.extend(info.config.layers[i].sinks)
    return c


def shard_cache_name(name: str, shard: int, num_shards: int) -> str:
    suffix = f"[shard {shard}/{num_shards}]"
    return f"{name[:127 - len(suffix)]} {suffix}" if name else suffix


# -- the clients' common part -----------------------------------------------------------------


def _tls_for_name(targets: TargetsLike, tls: Union[bool, TLS]) -> Union[bool, TLS]:
    """With TLS and one DNS name, the certificates are checked against the name, not the IP."""
    if not tls or not isinstance(targets, str):
        return tls
    t = tls if isinstance(tls, TLS) else TLS()
    if t.server_name:
        return t
    host, _ = _split_host_port(targets, None)
    return TLS(ca=t.ca, cert=t.cert, key=t.key, server_name=host)


def _failed(outcomes: Sequence[Any]) -> list[tuple[int, BaseException]]:
    return [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]


def _raise_first_failure(outcomes: Sequence[Any], targets: Sequence[str], doing: str) -> None:
    error = first_failure(outcomes, targets, doing)
    if error is not None:
        raise error from error.original


class _ShardedClientBase:
    """What ShardedClient and pagedattn.aio.ShardedClient share: the shards' clients and the
    plan of create_cache."""

    clients: list[Any]

    def _connect(self, client_type: type, targets: TargetsLike, token: Optional[str],
                 tls: Union[bool, TLS], timeout: Optional[float], max_message_bytes: int,
                 options: Sequence[tuple[str, Any]]) -> None:
        tls = _tls_for_name(targets, tls)
        options = _common.channel_options(options)  # once: a generator would reach one shard
        # Every shard checked before any channel is opened (an aio client's channel could not be
        # closed here: its close() is a coroutine).
        shards = list(resolve_targets(targets))
        for t in shards:
            if isinstance(t, str):
                _common.check_target(t)
            elif not isinstance(t, client_type):
                raise TypeError(f"a shard is a target string or a {client_type.__module__}."
                                f"{client_type.__name__} (got {t!r})")
        # The same server twice would hold two shards' heads in two caches: a mistake in the
        # list, refused before anything is sent.
        first: dict[str, int] = {}
        for i, t in enumerate(t if isinstance(t, str) else t.target for t in shards):
            if t in first:
                raise ValueError(f"shard targets {first[t]} and {i} are the same ({t}): each "
                                 "shard needs its own server")
            first[t] = i
        self.clients = []
        self._owned: list[Any] = []
        for t in shards:
            if isinstance(t, client_type):
                self.clients.append(t)
            else:
                c = client_type(t, token, tls=tls, timeout=timeout,
                                max_message_bytes=max_message_bytes, options=options)
                self.clients.append(c)
                self._owned.append(c)
        self.targets: list[str] = [c.target for c in self.clients]

    @property
    def num_shards(self) -> int:
        return len(self.clients)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.targets!r})"

    def _create_requests(self, configs: Sequence[pb.CacheConfig],
                         name: str) -> list[pb.CreateCacheRequest]:
        n = self.num_shards
        return [pb.CreateCacheRequest(config=c, name=shard_cache_name(name, i, n))
                for i, c in enumerate(configs)]

    @staticmethod
    def _undo_requests(outcomes: Sequence[Any]) -> list[Optional[pb.DeleteCacheRequest]]:
        return [None if isinstance(o, BaseException) else pb.DeleteCacheRequest(
            cache_id=o.cache_id) for o in outcomes]

    def _create_failure(self, outcomes: Sequence[Any], created: Sequence[Any],
                        deleted: Sequence[Any]) -> BaseException:
        gone = [i for i, d in enumerate(deleted)
                if d is not None and not isinstance(d, BaseException)]
        after = ""
        if gone:
            after += (f"; deleted the cache{'s' if len(gone) > 1 else ''} created on "
                      f"shard{'s' if len(gone) > 1 else ''} " + ", ".join(map(str, gone)))
        for i, d in enumerate(deleted):
            if isinstance(d, BaseException):
                after += (f"; could NOT delete the cache {created[i].cache_id} created on "
                          f"{shard_name(i, self.targets[i])}: {_describe(d)}")
        return shard_error(_failed(outcomes), self.targets, self.num_shards, "in CreateCache",
                           after=after)


class _ShardedCacheBase:
    """What ShardedCache and pagedattn.aio.ShardedCache share: the shards, the requests of
    each call, and what their answers mean."""

    def __init__(self, client: Any, shards: Sequence[Any], *, delete_on_exit: bool = True) -> None:
        self.client = client
        self.shards = list(shards)
        # Shard i's cache goes to shard i's server: a cache of another client there would take
        # the calls meant for another (and NOT_FOUND there reads as "deleted already").
        if len(self.shards) != len(client.clients) or any(
                s.client is not c for s, c in zip(self.shards, client.clients)):
            raise ValueError(
                "a sharded cache's shards must be caches of its client's shard clients, in "
                f"order: shard i of ShardedClient({client.targets}) is clients[i]'s")
        self.delete_on_exit = delete_on_exit
        self.config = full_config([s.info for s in self.shards])

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def cache_ids(self) -> list[str]:
        return [s.cache_id for s in self.shards]

    @property
    def targets(self) -> list[str]:
        return self.client.targets

    @property
    def deleted(self) -> bool:
        """True once every shard's cache is deleted."""
        return all(s.deleted for s in self.shards)

    def q_heads(self, shard: int) -> range:
        """The query heads that `shard` holds."""
        return head_range(self.config.num_q_heads, self.num_shards, shard)

    def kv_heads(self, shard: int) -> range:
        """The KV heads that `shard` holds."""
        return head_range(self.config.num_kv_heads, self.num_shards, shard)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cache_ids={self.cache_ids!r}, targets={self.targets!r})"

    def _forward_requests(
        self, layer: int, spans: list[pb.Span], q: Any, k: Any, v: Any,
        causal: Optional[bool], sm_scale: Optional[float], return_lse: bool,
        dtype: Optional[DTypeLike],
    ) -> tuple[list[pb.ForwardRequest], list[Any]]:
        """Each shard's ForwardRequest, and its q (the kind of array its answer comes as)."""
        parts = split_heads(q, k, v, self.config, spans, self.num_shards)
        requests = [
            _common.forward_request(shard.cache_id, layer, spans, qs, ks, vs, causal, sm_scale,
                                    return_lse, dtype)
            for shard, (qs, ks, vs) in zip(self.shards, parts)
        ]
        return requests, [p[0] for p in parts]

    @staticmethod
    def _forward_answer(outcomes: Sequence[Any], likes: Sequence[Any], return_lse: bool) -> Any:
        return join_results(
            [_common.forward_result(r, like, return_lse) for r, like in zip(outcomes, likes)],
            return_lse)

    def _rollback_requests(self, layer: int, spans: Sequence[pb.Span],
                           outcomes: Sequence[Any]) -> Optional[list[pb.TruncateSequencesRequest]]:
        """Every shard's TruncateSequences undoing a forward that failed somewhere, or None
        when nothing needs undoing (no span writes, or every shard failed before writing)."""
        lengths = sequence_lengths(rollback_lengths(spans))
        if not lengths or all(
                isinstance(o, BaseException)
                and nothing_written(o, getattr(c, "receive_limit", None))
                for o, c in zip(outcomes, self.client.clients)):
            return None
        return [pb.TruncateSequencesRequest(cache_id=s.cache_id, layer=checked_int32("layer", layer), lengths=lengths)
                for s in self.shards]

    def _release_requests(self, seq_ids: Sequence[int]) -> list[pb.ReleaseSequencesRequest]:
        ids = seq_id_list(seq_ids)
        return [pb.ReleaseSequencesRequest(cache_id=s.cache_id, seq_ids=ids) for s in self.shards]

    def _truncate_requests(self, layer: int,
                           lengths: LengthsLike) -> list[pb.TruncateSequencesRequest]:
        protos = sequence_lengths(lengths)
        return [pb.TruncateSequencesRequest(cache_id=s.cache_id, layer=checked_int32("layer", layer), lengths=protos)
                for s in self.shards]

    def _get_requests(self) -> list[pb.GetCacheRequest]:
        return [pb.GetCacheRequest(cache_id=s.cache_id) for s in self.shards]

    def _keep_infos(self, infos: Sequence[pb.CacheInfo]) -> None:
        for shard, info in zip(self.shards, infos):
            shard.info = info

    def _delete_requests(self) -> list[Optional[pb.DeleteCacheRequest]]:
        return [None if s.deleted else pb.DeleteCacheRequest(cache_id=s.cache_id)
                for s in self.shards]

    def _deleted(self, outcomes: Sequence[Any]) -> int:
        """Marks the shards deleted; the bytes freed; raises the first failure."""
        freed = 0
        outcomes = list(outcomes)
        for i, (shard, o) in enumerate(zip(self.shards, outcomes)):
            if isinstance(o, pb.DeleteCacheResponse):
                shard.deleted = True
                freed += o.freed_bytes
            elif isinstance(o, NotFound):  # gone already (its server restarted, say)
                shard.deleted = True
                outcomes[i] = None
        _raise_first_failure(outcomes, self.targets, "in DeleteCache")
        return freed


# -- the blocking client ---------------------------------------------------------------------


class ShardedClient(_ShardedClientBase):
    """Connections to the N servers of sharded caches, one pagedattn.Client each.

    Args:
        targets: the servers, in shard order: a list of "host:port" / "unix:/path" targets
            (or pagedattn.Client objects, used as they are and not closed here), or one
            "name:port" string whose A/AAAA records are resolved (targets_from_dns: sorted, so
            that every client numbers the shards alike). With tls and a name, the servers'
            certificates are checked against the name (TLS.server_name) unless set.
        token, tls, timeout, max_message_bytes, options: as pagedattn.Client, for each server.

    Every shard must be reached at the same place in the list for the life of its caches:
    shard i of a cache holds the heads of shard i only. Thread-safe as pagedattn.Client.
    """

    def __init__(
        self,
        targets: TargetsLike,
        token: Optional[str] = None,
        *,
        tls: Union[bool, TLS] = False,
        timeout: Optional[float] = _common.DEFAULT_TIMEOUT_S,
        max_message_bytes: int = _common.DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._connect(Client, targets, token, tls, timeout, max_message_bytes, options)

    def close(self) -> None:
        """Closes the channels this client opened (not the Clients it was given)."""
        for c in self._owned:
            c.close()

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def fan_out(
        self, method: str, requests: Sequence[Optional[Any]], timeout: Optional[float] = None
    ) -> list[Any]:
        """Sends requests[i] to shard i with the stub's `method` ("Forward", ...), all at once
        (None: nothing to shard i), and waits for every answer. Returns, by shard, the answer,
        the pagedattn exception of a failed call, or None."""
        if timeout is not None:
            _common.check_timeout(timeout)  # before any shard is sent anything
        # (call, None), or (None, the exception of a call that could not start), or None.
        calls: list[Any] = []
        for client, request in zip(self.clients, requests):
            if request is None:
                calls.append(None)
                continue
            try:
                client._check_open()
                calls.append((getattr(client.stub, method).future(
                    request, timeout=_common.grpc_timeout(client.timeout, timeout),
                    metadata=_common.call_metadata(client._metadata)), None))
            except Exception as e:  # e.g. a closed client (ClientClosed)
                calls.append((None, e))
        out: list[Any] = []
        for started in calls:
            if started is None or started[0] is None:
                out.append(None if started is None else started[1])
                continue
            try:  # a failed call (a grpc.RpcError) is an exception object itself
                out.append(started[0].result())
            except grpc.RpcError as e:
                out.append(from_rpc_error(e))
            except Exception as e:
                out.append(e)
        return out

    def _each(self, method: str, requests: Sequence[Any], timeout: Optional[float],
              doing: str) -> list[Any]:
        outcomes = self.fan_out(method, requests, timeout)
        _raise_first_failure(outcomes, self.targets, doing)
        return outcomes

    def server_info(self, *, timeout: Optional[float] = None) -> list[pb.ServerInfo]:
        """Each server's ServerInfo, by shard."""
        return self._each("GetServerInfo", [pb.GetServerInfoRequest()] * self.num_shards,
                          timeout, "in GetServerInfo")

    def validate(
        self, config: ConfigLike, *, timeout: Optional[float] = None
    ) -> list[pb.ValidateCacheConfigResponse]:
        """Each shard's dry run of its part of `config` (see create_cache), by shard. Raises
        CacheConfigError when the heads do not split over the shards."""
        return self._each("ValidateCacheConfig", shard_configs(config, self.num_shards),
                          timeout, "in ValidateCacheConfig")

    def create_cache(
        self,
        config: ConfigLike,
        name: str = "",
        *,
        delete_on_exit: bool = True,
        timeout: Optional[float] = None,
    ) -> "ShardedCache":
        """Creates a cache of `config` split by head over the shards: shard i gets
        num_kv_heads/N KV heads and num_q_heads/N query heads, the same num_pages (each holds
        every sequence's pages for its heads; max_bytes is the budget of all shards together,
        split evenly), named "<name> [shard i/N]".

        The config is checked whole first (num_kv_heads divisible by N: CacheConfigError naming
        num_kv_heads, N and the shard counts that would work), then each shard's part on its
        server (ValidateCacheConfig): a CacheConfigError whose message and violations'
        descriptions name the shard (index and target), with `.shard`, `.target` and `.shards`
        (every invalid one). Then every shard's cache is created; when one fails, those created
        are deleted and its exception (e.g. ResourceExhausted) is raised naming the shard.

        `with client.create_cache(...) as cache:` deletes every shard's cache on exit."""
        _common.check_cache_name(name)
        configs = shard_configs(config, self.num_shards)
        error = validation_error(self.fan_out("ValidateCacheConfig", configs, timeout),
                                 self.targets)
        if error is not None:
            raise error from getattr(error, "original", None)
        outcomes = self.fan_out("CreateCache", self._create_requests(configs, name), timeout)
        if _failed(outcomes):
            created = self._undo_requests(outcomes)
            deleted = self.fan_out("DeleteCache", created, timeout)
            error = self._create_failure(outcomes, created, deleted)
            raise error from error.original
        shards = [Cache(c, info, delete_on_exit=False) for c, info in zip(self.clients, outcomes)]
        return ShardedCache(self, shards, delete_on_exit=delete_on_exit)


class ShardedCache(_ShardedCacheBase):
    """One logical cache made of a cache on each shard (ShardedClient.create_cache): `shards`
    (the pagedattn.Cache of each, in shard order), `config` (the whole cache's: every head,
    the pages of the smallest shard), `cache_ids`, `targets`, and q_heads(i) / kv_heads(i)
    (the heads of shard i). A context manager: deletes every shard's cache on exit when
    created with delete_on_exit=True (the default).

    Calls that write the same sequences in the same layer must not overlap (on one server the
    later one wins; here a rollback could rewind the other's tokens)."""

    client: ShardedClient

    def forward(
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
        """Client.forward over the shards: q [total_queries, num_q_heads, head_dim] and k/v
        [total_new_tokens, num_kv_heads, head_dim] of the whole cache are split by head, every
        shard's Forward is sent at once, and the answers are joined along the head axis: out
        (and lse) as one server holding the whole cache would return them (sm_scale's default,
        1/sqrt(head_dim), is the same): bit for bit on the CPU backend, up to rounding on CUDA.

        When some shards fail, every shard is rolled back: TruncateSequences of `layer` to each
        appending span's start (not sent when every shard failed before writing anything). For
        spans that append at a sequence's end this restores the cache as it was; rows that a
        rewinding span (start < length) replaced are not restored (the sequence ends at start
        on every shard: a retry writes them again). Then the first failed shard's exception is
        raised, the class unary forward raises (OutOfPages, Unavailable, ...) with its
        attributes, its message naming the shard (index, target) and any other failed shard,
        and saying whether the rollback worked; it carries `shard`, `target`, `shard_errors`,
        `rolled_back` (shards rolled back), `rollback_errors` ({shard: exception}: a shard that
        could not be rolled back, e.g. a server that is down, may keep the call's tokens) and
        `original` (the shard's own exception, also its __cause__). A call interrupted in the
        caller (KeyboardInterrupt) is not rolled back: truncate() those spans' sequences to
        their starts before using them again (pagedattn.aio's cancelled forward is)."""
        spans = span_protos(spans)
        requests, likes = self._forward_requests(layer, spans, q, k, v, causal, sm_scale,
                                                 return_lse, dtype)
        outcomes = self.client.fan_out("Forward", requests, timeout)
        if not _failed(outcomes):
            return self._forward_answer(outcomes, likes, return_lse)
        undo = self._rollback_requests(layer, spans, outcomes)
        rollback = None if undo is None else self.client.fan_out("TruncateSequences", undo,
                                                                 timeout)
        error = forward_failure(outcomes, self.targets, rollback)
        raise error from error.original

    def release(self, seq_ids: Sequence[int], *,
                timeout: Optional[float] = None) -> list[pb.ReleaseSequencesResponse]:
        """Frees the sequences on every shard; each shard's answer, by shard. When a shard
        fails, the others have released them still, and its exception names it."""
        return self.client._each("ReleaseSequences", self._release_requests(seq_ids), timeout,
                                 "in ReleaseSequences")

    def truncate(self, layer: int, lengths: LengthsLike, *,
                 timeout: Optional[float] = None) -> list[pb.TruncateSequencesResponse]:
        """Client.truncate on every shard (e.g. rejected speculative tokens); each shard's
        answer, by shard."""
        return self.client._each("TruncateSequences", self._truncate_requests(layer, lengths),
                                 timeout, "in TruncateSequences")

    def refresh(self, *, timeout: Optional[float] = None) -> list[pb.CacheInfo]:
        """Each shard's CacheInfo now (kept in shards[i].info), by shard."""
        infos = self.client._each("GetCache", self._get_requests(), timeout, "in GetCache")
        self._keep_infos(infos)
        return infos

    def stats(self, *, timeout: Optional[float] = None) -> list[pb.CacheStats]:
        """Each shard's live stats, by shard (used pages and live sequences are the same on
        every shard, unless a rollback failed)."""
        return [info.stats for info in self.refresh(timeout=timeout)]

    def delete(self, *, timeout: Optional[float] = None) -> int:
        """Deletes every shard's cache not deleted yet; returns the bytes freed. When a shard
        fails (e.g. its server is down), the others are deleted still and its exception,
        naming it, is raised; delete() again retries that shard. A shard whose cache is gone
        already (NOT_FOUND: its server restarted, say) counts as deleted, and a cache deleted
        already is not sent again: delete() then returns 0."""
        return self._deleted(self.client.fan_out("DeleteCache", self._delete_requests(), timeout))

    def __enter__(self) -> "ShardedCache":
        return self

    def __exit__(self, exc_type: Any, error: Any, tb: Any) -> None:
        if self.delete_on_exit and not self.deleted:
            try:
                self.delete()
            except Exception as e:
                if exc_type is None:
                    raise
                # The block's own exception goes on, noting the shards' caches left behind.
                _common.cleanup_failed_during(
                    error, e, "the sharded cache (its caches left: "
                    + ", ".join(f"{s.cache_id} on {t}" for s, t in zip(self.shards, self.targets)
                                if not s.deleted) + ")")
