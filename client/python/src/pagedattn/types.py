"""Friendly Python types for the API's messages: CacheConfig and Span (dataclasses that convert
to and from the pagedattn.v1 protos; every call also takes the raw protos)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from .tensors import DTypeLike, dtype_enum, dtype_name
from .v1 import attention_pb2 as pb


@dataclass
class CacheConfig:
    """The configuration of one paged KV cache (pagedattn.v1.CacheConfig).

    Capacity: `num_pages`, or `max_bytes` (as many whole pages as fit), or neither (the largest
    pool that fits in 90% of the free device memory). A page holds `page_size` tokens of every
    layer: bytes = num_pages * 2 * num_layers * num_kv_heads * page_size * head_dim * itemsize
    (a float8_e4m3 cache with per_token scales adds 4 bytes a row of K and of V for its scales).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    # float16/bfloat16/float8_e4m3 (float32 on the CPU backend only)
    kv_dtype: DTypeLike = "bfloat16"
    num_pages: Optional[int] = None
    max_bytes: Optional[int] = None
    device: int = 0  # CUDA device index; 0 on the CPU backend
    # Per-layer attention variants: () for none, one LayerAttention for every layer, or one per
    # layer (see LayerAttention and ServerInfo.capabilities.supports_*).
    layers: Sequence["LayerAttention"] = ()
    # float8_e4m3 caches: "per_token" (default: each row its own scale, computed at append) or
    # "static" with kv_scales (K's and V's scale, for every layer or per layer: 2 or
    # 2 * num_layers values).
    kv_scaling: Optional[str] = None
    kv_scales: Sequence[float] = ()

    def to_proto(self) -> pb.CacheConfig:
        msg = pb.CacheConfig(
            num_layers=checked_int32("CacheConfig.num_layers", self.num_layers),
            num_q_heads=checked_int32("CacheConfig.num_q_heads", self.num_q_heads),
            num_kv_heads=checked_int32("CacheConfig.num_kv_heads", self.num_kv_heads),
            head_dim=checked_int32("CacheConfig.head_dim", self.head_dim),
            page_size=checked_int32("CacheConfig.page_size", self.page_size),
            kv_dtype=_kv_dtype_enum(self.kv_dtype),
            device=checked_int32("CacheConfig.device", self.device),
        )
        if self.num_pages is not None and self.max_bytes is not None:
            raise ValueError("CacheConfig: set num_pages or max_bytes, not both")
        if self.num_pages is not None:
            msg.num_pages = checked_int("CacheConfig.num_pages", self.num_pages)
        if self.max_bytes is not None:
            msg.max_bytes = checked_int("CacheConfig.max_bytes", self.max_bytes)
        if isinstance(self.layers, LayerAttention):
            raise TypeError("layers is a list of LayerAttention (got one; [it] holds for every layer)")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerAttention):
                raise TypeError(f"layers[{i}] must be a pagedattn.LayerAttention (got {layer!r})")
            msg.layers.append(layer.to_proto())
        if self.kv_scaling is not None:
            msg.kv_scaling = _kv_scaling_enum(self.kv_scaling)
        msg.kv_scales.extend(checked_float(f"CacheConfig.kv_scales[{i}]", x)
                             for i, x in enumerate(checked_sequence("CacheConfig.kv_scales",
                                                                    self.kv_scales)))
        return msg

    @classmethod
    def from_proto(cls, msg: pb.CacheConfig) -> "CacheConfig":
        capacity = msg.WhichOneof("capacity")
        return cls(
            num_layers=msg.num_layers,
            num_q_heads=msg.num_q_heads,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            page_size=msg.page_size,
            kv_dtype=dtype_name(msg.kv_dtype),
            num_pages=msg.num_pages if capacity == "num_pages" else None,
            max_bytes=msg.max_bytes if capacity == "max_bytes" else None,
            device=msg.device,
            layers=tuple(LayerAttention.from_proto(layer) for layer in msg.layers),
            kv_scaling=(pb.KvScaling.Name(msg.kv_scaling).lower()
                        if msg.kv_scaling != pb.KV_SCALING_UNSPECIFIED else None),
            kv_scales=tuple(msg.kv_scales),
        )


def _kv_dtype_enum(dtype: Any) -> int:
    """CacheConfig.kv_dtype's DType value, or an error naming the field: dtype_enum's own speak of
    tensors, and np.dtype(None) would be float64."""
    try:
        if dtype is not None:
            return dtype_enum(dtype)
    except (TypeError, ValueError):
        pass
    raise (TypeError if dtype is None or not isinstance(dtype, str) else ValueError)(
        f"CacheConfig.kv_dtype must be float16, bfloat16, float32 or float8_e4m3 (got {dtype!r})")


def _kv_scaling_enum(scaling: Any) -> int:
    """CacheConfig.kv_scaling's KvScaling value: a name in any case, or the enum's value."""
    why = (f"CacheConfig.kv_scaling must be 'per_token' or 'static' (or pagedattn.pb.PER_TOKEN, "
           f"pagedattn.pb.STATIC), or None for the default (got {scaling!r})")
    if isinstance(scaling, str):
        if scaling.upper() in pb.KvScaling.keys():
            return pb.KvScaling.Value(scaling.upper())
        raise ValueError(why)
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Integral):
        raise TypeError(why)
    if int(scaling) not in pb.KvScaling.values():
        raise ValueError(why)
    return int(scaling)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention variant (pagedattn.v1.LayerAttention); None / () for none.

    sliding_window: a query at position p attends p - sliding_window + 1 .. p (Mistral, Gemma).
    logit_softcap: scores become cap * tanh(score / cap) before the softmax (Gemma 2).
    sinks: one logit per q head joining each row's softmax denominator (gpt-oss).
    """

    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    sinks: Sequence[float] = ()

    def __post_init__(self) -> None:
        # Kept as a tuple: a frozen value that hashes and compares (a numpy array given as the
        # sinks did neither).
        if not isinstance(self.sinks, tuple):
            object.__setattr__(self, "sinks",
                               tuple(checked_sequence("LayerAttention.sinks", self.sinks)))

    def to_proto(self) -> pb.LayerAttention:
        msg = pb.LayerAttention(
            sinks=[checked_float(f"LayerAttention.sinks[{i}]", x) for i, x in enumerate(self.sinks)])
        if self.sliding_window is not None:
            msg.sliding_window = checked_int32("LayerAttention.sliding_window", self.sliding_window)
        if self.logit_softcap is not None:
            msg.logit_softcap = checked_float("LayerAttention.logit_softcap", self.logit_softcap)
        return msg

    @classmethod
    def from_proto(cls, msg: pb.LayerAttention) -> "LayerAttention":
        return cls(
            sliding_window=msg.sliding_window if msg.HasField("sliding_window") else None,
            logit_softcap=msg.logit_softcap if msg.HasField("logit_softcap") else None,
            sinks=tuple(msg.sinks),
        )


ConfigLike = Union[CacheConfig, pb.CacheConfig]


def config_proto(config: ConfigLike) -> pb.CacheConfig:
    if isinstance(config, pb.CacheConfig):
        return config
    if isinstance(config, CacheConfig):
        return config.to_proto()
    raise TypeError(f"expected pagedattn.CacheConfig or pagedattn.v1 CacheConfig (got {type(config)})")


_SEQ_ID_MAX = 2**64 - 1  # seq_id is a uint64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def checked_int(name: str, value: Any, lo: int = _INT64_MIN, hi: int = _INT64_MAX) -> int:
    """value as an int for the field `name`, or a TypeError / ValueError that names the field
    (protobuf's own say only "Value out of range" or "cannot be interpreted as an integer")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi} (got {value})")
    return int(value)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def checked_int32(name: str, value: Any) -> int:
    """checked_int for an int32 field."""
    return checked_int(name, value, _INT32_MIN, _INT32_MAX)


def checked_bool(name: str, value: Any) -> bool:
    """value as a bool for the field `name` (True/False, numpy's too), else a TypeError naming
    it: protobuf would take 0 and 1, and say only "cannot be interpreted as an integer"."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False (got {type(value).__name__} {value!r})")
    return bool(value)


def checked_float(name: str, value: Any) -> float:
    """value as a float for the field `name` (any real number but a bool), else a TypeError.
    The wire's type is float32: a finite value that would arrive as 0 or inf is a ValueError
    naming it as given, not a server error naming the 0 or inf it became."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number (got {type(value).__name__} {value!r})")
    x = float(value)
    if math.isfinite(x) and x != 0:
        with np.errstate(over="ignore", under="ignore"):
            narrowed = np.float32(x)
        if narrowed == 0 or not np.isfinite(narrowed):
            raise ValueError(f"{name} is {value!r}, outside float32's range (the field's type)")
    return x


def checked_sequence(name: str, value: Any) -> Any:
    """value, when it is a sequence of values for the field `name` (a list, a tuple, a numpy
    array...), else a TypeError naming it: a number or a string is none."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of numbers (got {type(value).__name__} "
                        f"{value!r})")
    return value


def seq_id_list(seq_ids: Iterable[int]) -> list[int]:
    """Sequence ids for a request, each checked (uint64)."""
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Iterable):
        one = isinstance(seq_ids, numbers.Integral) and not isinstance(seq_ids, bool)
        raise TypeError(f"seq_ids is a list of sequence ids (got {type(seq_ids).__name__} "
                        f"{seq_ids!r}" + (f": [{seq_ids!r}] would do)" if one else ")"))
    return [checked_int(f"seq_ids[{i}]", s, 0, _SEQ_ID_MAX) for i, s in enumerate(seq_ids)]


@dataclass(frozen=True)
class Span:
    """One sequence's piece of a Forward: write `num_new_tokens` K/V rows at positions
    start..start+num_new_tokens-1, then attend its `num_queries` queries (the last positions)."""

    seq_id: int
    start: int
    num_new_tokens: int
    num_queries: int

    @classmethod
    def prefill(cls, seq_id: int, num_tokens: int, start: int = 0) -> "Span":
        """Append `num_tokens` tokens at `start` (0 for a new sequence) and query all of them."""
        return cls(seq_id, start, num_tokens, num_tokens)

    @classmethod
    def decode(cls, seq_id: int, position: int) -> "Span":
        """Append one token at `position` (the sequence's length) and query it."""
        return cls(seq_id, position, 1, 1)

    @classmethod
    def attend(cls, seq_id: int, length: int, num_queries: int = 1) -> "Span":
        """Append nothing; query the last `num_queries` positions of a `length`-token sequence."""
        return cls(seq_id, length, 0, num_queries)

    def __post_init__(self) -> None:
        # The server checks what the values mean (a gap, too many queries); these are what the
        # wire can carry, named here rather than in protobuf's words.
        checked_int("Span.seq_id", self.seq_id, 0, _SEQ_ID_MAX)
        checked_int("Span.start", self.start)
        for name in ("num_new_tokens", "num_queries"):  # int32 fields
            checked_int32(f"Span.{name}", getattr(self, name))

    def to_proto(self) -> pb.Span:
        return pb.Span(
            seq_id=self.seq_id,
            start=self.start,
            num_new_tokens=self.num_new_tokens,
            num_queries=self.num_queries,
        )


SpanLike = Union[Span, pb.Span, tuple]


def span_protos(spans: Iterable[SpanLike]) -> list[pb.Span]:
    if isinstance(spans, (Span, pb.Span)):
        raise TypeError(f"spans is a list of spans (got one span: [{spans!r}] would do)")
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Iterable):
        raise TypeError(f"spans is a list of spans: Span, pagedattn.v1 Span or (seq_id, start, "
                        f"num_new_tokens, num_queries) (got {type(spans).__name__})")
    out = []
    for s in spans:
        if isinstance(s, pb.Span):
            out.append(s)
        elif isinstance(s, Span):
            out.append(s.to_proto())
        elif isinstance(s, tuple) and len(s) == 4:
            out.append(Span(*s).to_proto())
        else:
            raise TypeError(
                f"a span is a pagedattn.Span, a pagedattn.v1 Span or a tuple "
                f"(seq_id, start, num_new_tokens, num_queries) (got {s!r})"
            )
    return out


# TruncateSequences lengths: {seq_id: length}, or (seq_id, length) pairs / SequenceLength protos.
LengthsLike = Union[Mapping[int, int], Iterable[Union[tuple, pb.SequenceLength]]]


def sequence_lengths(lengths: LengthsLike) -> list[pb.SequenceLength]:
    if isinstance(lengths, Mapping):
        lengths = lengths.items()
    out = []
    for x in lengths:
        if isinstance(x, pb.SequenceLength):
            out.append(x)
        elif isinstance(x, tuple) and len(x) == 2:
            out.append(pb.SequenceLength(seq_id=checked_int("seq_id", x[0], 0, _SEQ_ID_MAX),
                                         length=checked_int("length", x[1])))
        else:
            raise TypeError(
                f"a length is a (seq_id, length) tuple or a pagedattn.v1 SequenceLength (got {x!r})"
            )
    return out


def cache_id_of(cache: Any) -> str:
    """The cache id of a Cache handle, a CacheInfo or a plain id string."""
    if isinstance(cache, str):
        return cache
    cid = getattr(cache, "cache_id", None)
    if isinstance(cid, str) and cid:
        return cid
    raise TypeError(f"expected a cache id, a Cache or a CacheInfo (got {type(cache)})")
