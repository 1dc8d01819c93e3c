"""pagedattn.Client against a real server: every method, every error type with its structure,
f32/f16/bf16 round trips against the float64 reference, big prefills, concurrent threads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import re
import signal
import subprocess
import sys
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

import pagedattn
from pagedattn import CacheConfig, Span, errors, pb
from pagedattn.reference import reference_attention, relative_error
from pagedattn.smoke import round_to
from pagedattn.tensors import dtype_enum

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def small_config(kv_dtype: str = "float16", **kw) -> CacheConfig:
    args = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                kv_dtype=kv_dtype, num_pages=16)
    args.update(kw)
    return CacheConfig(**args)


def issue_config() -> CacheConfig:
    """The issue's invalid config: page_size 0, head_dim 100, 32 q heads over 5 kv heads, no dtype."""
    return CacheConfig(num_layers=2, num_q_heads=32, num_kv_heads=5, head_dim=100, page_size=0,
                       kv_dtype="dtype_unspecified", num_pages=8)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


# -- metadata RPCs ---------------------------------------------------------------------------


def test_server_info_has_capability_table(server_info, backend):
    assert server_info.version
    assert backend in ("cpu", "cuda")
    assert list(server_info.capabilities.head_dims) == [64, 80, 96, 128, 192, 256, 512]
    assert server_info.capabilities.min_page_size == 1
    assert server_info.capabilities.max_page_size == 1024
    assert (pb.FLOAT32 in server_info.capabilities.kv_dtypes) == (backend == "cpu")
    assert server_info.device_memory_bytes > 0


def test_health_is_serving(client):
    assert client.health() is True


def test_validate_reports_every_violation_and_allocates_nothing(client):
    before = len(client.list_caches())
    r = client.validate(issue_config())
    assert not r.valid
    assert sorted(v.field for v in r.violations) == ["head_dim", "kv_dtype", "num_q_heads", "page_size"]
    ok = client.validate(small_config(num_pages=8))
    assert ok.valid and ok.fits
    assert ok.num_pages == 8
    assert ok.capacity_tokens == 8 * 4
    assert ok.bytes == 8 * 2 * 2 * 2 * 4 * 64 * 2  # pages x K,V x layers x kv heads x page x dim x f16
    assert len(client.list_caches()) == before
    # The raw proto works as well as the dataclass.
    assert client.validate(small_config().to_proto()).valid


def test_cache_lifecycle(client, kv_dtypes):
    config = small_config(kv_dtypes[0])
    with client.create_cache(config, name="py-lifecycle") as cache:
        assert len(cache.cache_id) == 32
        assert cache.info.name == "py-lifecycle"
        assert cache.config.num_pages == 16
        assert pagedattn.CacheConfig.from_proto(cache.config) == config
        assert cache.cache_id in [c.cache_id for c in client.list_caches()]
        info = client.get_cache(cache.cache_id)
        assert info.stats.free_pages == 16 and info.stats.used_pages == 0
        assert client.get_cache(cache).cache_id == cache.cache_id  # a handle works as an id
    assert cache.deleted
    with pytest.raises(errors.NotFound) as e:
        client.get_cache(cache.cache_id)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert cache.cache_id in e.value.message

    # Gone already when the block ends (its server restarted, another handle deleted it): the
    # block's end has nothing to delete, as a ShardedCache's has not.
    with client.create_cache(config) as gone:
        client.delete_cache(gone.cache_id)
    assert gone.deleted

    kept = client.create_cache(config, delete_on_exit=False)
    with kept:
        pass
    assert client.get_cache(kept).cache_id == kept.cache_id
    assert client.delete_cache(kept.cache_id) == kept.info.bytes


def test_list_caches_follows_every_page(client, kv_dtypes):
    config = small_config(kv_dtypes[0])
    made = []
    for i in range(3):  # the listing's order is the order they were made
        made.append(client.create_cache(config, name=f"py-page-{i}"))
    try:
        ids = [c.cache_id for c in made]
        for page_size in (0, 1, 2):
            listed = [c.cache_id for c in client.list_caches(page_size=page_size)]
            assert [i for i in listed if i in ids] == ids, page_size
        one = client.stub.ListCaches(pb.ListCachesRequest(page_size=1))
        assert len(one.caches) == 1 and one.next_page_token
        with pytest.raises(errors.InvalidArgument):
            client.list_caches(page_size=-1)
    finally:
        for c in made:
            c.delete()


# -- errors, with their structure ------------------------------------------------------------


def test_create_cache_invalid_raises_cache_config_error_with_violations(client):
    with pytest.raises(errors.CacheConfigError) as e:
        client.create_cache(issue_config())
    err = e.value
    assert isinstance(err, errors.InvalidArgument) and isinstance(err, errors.PagedAttnError)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "4 violations" in err.message
    assert sorted(err.fields) == ["head_dim", "kv_dtype", "num_q_heads", "page_size"]
    described = dict(err.violations)
    assert "(got 0" in described["page_size"]
    assert "nearest valid: 30 or 35" in described["num_q_heads"]
    # The google.rpc.Status from the grpc-status-details-bin trailer, as sent.
    assert err.status is not None and err.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert err.status.details[0].type_url.endswith("google.rpc.BadRequest")
    assert str(err).startswith("INVALID_ARGUMENT: invalid cache config")


def test_a_refused_cache_name_is_a_violation_of_name(client):
    with pytest.raises(errors.CacheConfigError) as e:
        client.create_cache(small_config(), name="tab\there")
    assert e.value.fields == ["name"] and "printable ASCII" in e.value.message
    with pytest.raises(errors.CacheConfigError) as e:  # listed with the config's own
        client.create_cache(issue_config(), name="n" * 129)
    assert e.value.fields[0] == "name" and len(e.value.fields) == 5
    assert "at most 128" in dict(e.value.violations)["name"]


def test_oversized_cache_is_resource_exhausted_with_numbers(client):
    with pytest.raises(errors.ResourceExhausted) as e:
        client.create_cache(small_config(num_pages=2 * 10**8))
    err = e.value
    assert not isinstance(err, errors.OutOfPages)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.num_pages == 2 * 10**8  # under 2^31 rows of a layer; 819 GB
    assert err.bytes_per_page == 2 * 2 * 2 * 4 * 64 * 2
    assert err.bytes_needed == err.num_pages * err.bytes_per_page
    assert 0 < err.free_bytes < err.bytes_needed
    assert err.max_pages == err.free_bytes // err.bytes_per_page


def test_out_of_pages_has_numbers_and_changes_nothing(client, kv_dtypes):
    rng = np.random.default_rng(1)
    with client.create_cache(small_config(kv_dtypes[0], num_pages=3)) as cache:  # 12 tokens
        cache.forward(0, [Span.prefill(1, 5)], randn(rng, 5, 4, 64), randn(rng, 5, 2, 64),
                      randn(rng, 5, 2, 64))  # 2 pages
        with pytest.raises(errors.OutOfPages) as e:
            cache.forward(0, [Span.prefill(2, 9)], randn(rng, 9, 4, 64), randn(rng, 9, 2, 64),
                          randn(rng, 9, 2, 64))  # 3 more pages, 1 free
        err = e.value
        assert isinstance(err, errors.ResourceExhausted)
        assert (err.pages_needed, err.free_pages, err.total_pages, err.page_size) == (3, 1, 3, 4)
        assert err.reason == "OUT_OF_PAGES"  # google.rpc.ErrorInfo, not the message text
        stats = cache.stats()
        assert (stats.used_pages, stats.live_sequences) == (2, 1)  # the failed Forward left nothing
        # Longer than the whole cache: RESOURCE_EXHAUSTED with the capacity.
        with pytest.raises(errors.ResourceExhausted) as e:
            cache.forward(0, [Span.prefill(3, 13)], randn(rng, 13, 4, 64), randn(rng, 13, 2, 64),
                          randn(rng, 13, 2, 64))
        assert (e.value.sequence_length, e.value.capacity_tokens) == (13, 12)
        assert e.value.reason == "SEQUENCE_TOO_LONG"


@pytest.mark.parametrize("method", ["TruncateSequences", "CreateCache", "GetCache", "Forward"])
def test_bytes_that_do_not_parse_are_invalid_argument(client, method):
    """Not INTERNAL with no message (what gRPC's generated handlers would answer: the server
    parses every request itself and names the message expected)."""
    call = client.channel.unary_unary(f"/pagedattn.v1.AttentionService/{method}",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
    junks = [b"\xff" * 10]  # a bad tag
    if method != "Forward":  # Forward's own parser takes any bytes as an id (then NOT_FOUND)
        junks.append(b"\x0a\x02\xff\xfe")  # field 1, a string that is not UTF-8
    for junk in junks:
        with pytest.raises(grpc.RpcError) as e:
            call(junk, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, junk, e.value.details())
        assert e.value.details(), (method, junk)


def test_not_found_errors(client, kv_dtypes):
    rng = np.random.default_rng(2)
    q, kv = randn(rng, 1, 4, 64), randn(rng, 1, 2, 64)
    with pytest.raises(errors.NotFound) as e:
        client.forward("0" * 32, 0, [Span.prefill(1, 1)], q, kv, kv)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        with pytest.raises(errors.NotFound) as e:
            cache.forward(0, [Span.attend(7, 5, 1)], q)  # attend-only on an unknown sequence
        assert "sequence 7 not found" in e.value.message
    with pytest.raises(errors.NotFound):
        client.delete_cache(cache.cache_id)


def test_position_gap_is_failed_precondition(client, kv_dtypes):
    rng = np.random.default_rng(3)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        cache.forward(0, [Span.prefill(1, 3)], randn(rng, 3, 4, 64), randn(rng, 3, 2, 64),
                      randn(rng, 3, 2, 64))
        with pytest.raises(errors.FailedPrecondition) as e:
            cache.forward(0, [Span.decode(1, 5)], randn(rng, 1, 4, 64), randn(rng, 1, 2, 64),
                          randn(rng, 1, 2, 64))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "start=5 leaves a gap" in e.value.message


def test_bad_shapes_and_fields_are_invalid_argument(client, kv_dtypes):
    rng = np.random.default_rng(4)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        with pytest.raises(errors.InvalidArgument) as e:  # 3 q heads, the cache has 4
            cache.forward(0, [Span.prefill(1, 2)], randn(rng, 2, 3, 64), randn(rng, 2, 2, 64),
                          randn(rng, 2, 2, 64))
        assert not isinstance(e.value, errors.CacheConfigError)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(errors.InvalidArgument) as e:
            cache.forward(7, [Span.prefill(1, 2)], randn(rng, 2, 4, 64), randn(rng, 2, 2, 64),
                          randn(rng, 2, 2, 64))
        assert "layer" in e.value.message
        with pytest.raises(ValueError):  # caught before sending: k without v
            cache.forward(0, [Span.prefill(1, 2)], randn(rng, 2, 4, 64), randn(rng, 2, 2, 64))
        # Caught before sending, naming the argument: which of q, k and v is wrong.
        with pytest.raises(TypeError, match=r"^q dtype must be float32, float16 or bfloat16 "
                           r"\(got int32\)"):
            cache.forward(0, [Span.prefill(1, 2)], np.zeros((2, 4, 64), np.int32))
        with pytest.raises(TypeError, match=r"^v dtype must be .* \(got int64\)"):
            cache.forward(0, [Span.prefill(1, 2)], randn(rng, 2, 4, 64), randn(rng, 2, 2, 64),
                          np.zeros((2, 2, 64), np.int64))
        assert cache.stats().used_pages == 0


def test_unreachable_server_is_unavailable():
    with pagedattn.Client("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(errors.Unavailable) as e:
            c.server_info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_math_inf_and_timeouts_past_grpcs_are_no_deadline(target, kv_dtypes):
    """math.inf, the client's or a call's, means no deadline, as does any timeout past 1e9 s (each
    failed every call at once with DEADLINE_EXCEEDED past about 7.4e9 s: grpc's deadline
    overflowed); 2**31 - 1, a common "forever", works as before."""
    with pagedattn.Client(target, timeout=math.inf) as c:
        assert c.health()
        assert c.server_info().backend
        config = CacheConfig(1, 4, 2, 64, page_size=4, kv_dtype=kv_dtypes[0], num_pages=8)
        with c.create_cache(config) as cache:
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((3, h, 64), dtype=np.float32) for h in (4, 2, 2))
            assert cache.forward(0, [Span.prefill(1, 3)], q, k, v).shape == (3, 4, 64)
            with c.step(cache, [Span.prefill(2, 3)], timeout=math.inf) as step:
                assert step.forward(0, q, k, v).shape == (3, 4, 64)
    with pagedattn.Client(target) as c:
        for forever in (math.inf, 1e12, 8e9, 2**31 - 1):
            assert c.health(timeout=forever)
    with pagedattn.Client(target, timeout=1e10) as c:
        assert c.health()


# -- numerics --------------------------------------------------------------------------------


def _spans_and_data(rng, wire: str, cache_dtype: str, hq: int, hkv: int, d: int):
    """A mixed batch (two prefills of ragged length and a 1-token one) with host copies of the
    values as the server stores them (rounded to the wire dtype, then to the cache dtype)."""
    spans = [Span.prefill(1, 37), Span.prefill(2, 5), Span.prefill(3, 1)]
    n = sum(s.num_new_tokens for s in spans)
    q = randn(rng, n, hq, d).astype(NUMPY_DTYPE[wire])
    k = randn(rng, n, hkv, d).astype(NUMPY_DTYPE[wire])
    v = randn(rng, n, hkv, d).astype(NUMPY_DTYPE[wire])
    stored = lambda x: round_to(dtype_enum(cache_dtype), x.astype(np.float32))  # noqa: E731
    return spans, q, k, v, stored(k), stored(v)


def _check(out, spans, q, k_ref, v_ref, tol, **ref_kw):
    row = 0
    for s in spans:
        qs = q[row : row + s.num_queries].astype(np.float32)
        ks = k_ref[row : row + s.num_new_tokens]
        vs = v_ref[row : row + s.num_new_tokens]
        ref, _ = reference_attention(qs, ks, vs, **ref_kw)
        err = relative_error(np.asarray(out[row : row + s.num_queries], np.float64), ref)
        assert err <= tol, f"span {s}: relative error {err:.3g} > {tol:g}"
        row += s.num_queries


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_matches_reference(client, kv_dtypes, wire, cache_dtype):
    if cache_dtype not in kv_dtypes:
        pytest.skip(f"the {cache_dtype} cache is not supported by this backend")
    rng = np.random.default_rng(10)
    hq, hkv, d = 8, 2, 128
    config = CacheConfig(1, hq, hkv, d, page_size=16, kv_dtype=cache_dtype, num_pages=16)
    with client.create_cache(config) as cache:
        spans, q, k, v, k_ref, v_ref = _spans_and_data(rng, wire, cache_dtype, hq, hkv, d)
        out = cache.forward(0, spans, q, k, v)
        assert out.dtype == NUMPY_DTYPE[wire] and out.shape == q.shape
        assert out.flags.writeable
        tol = max(TOLERANCE[wire], TOLERANCE[cache_dtype])
        _check(out, spans, q, k_ref, v_ref, tol)
        # Decode one token per sequence on top: attends the whole cached prefix.
        q2, k2, v2 = (randn(rng, 3, h, d).astype(NUMPY_DTYPE[wire]) for h in (hq, hkv, hkv))
        lengths = [s.num_new_tokens for s in spans]
        out2 = cache.forward(0, [Span.decode(s.seq_id, n) for s, n in zip(spans, lengths)], q2, k2, v2)
        row = 0
        for i, (s, n) in enumerate(zip(spans, lengths)):
            ks = np.concatenate([k_ref[row : row + n], round_to(dtype_enum(cache_dtype), k2[i : i + 1].astype(np.float32))])
            vs = np.concatenate([v_ref[row : row + n], round_to(dtype_enum(cache_dtype), v2[i : i + 1].astype(np.float32))])
            ref, _ = reference_attention(q2[i : i + 1].astype(np.float32), ks, vs)
            assert relative_error(np.asarray(out2[i : i + 1], np.float64), ref) <= tol
            row += n


def test_options_lse_non_causal_scale_and_wire_conversion(client, kv_dtypes):
    rng = np.random.default_rng(11)
    cache_dtype = kv_dtypes[0]
    config = CacheConfig(1, 4, 2, 64, page_size=8, kv_dtype=cache_dtype, num_pages=8)
    with client.create_cache(config) as cache:
        q, k, v = randn(rng, 9, 4, 64), randn(rng, 9, 2, 64), randn(rng, 9, 2, 64)
        out, lse = cache.forward(0, [Span.prefill(1, 9)], q, k, v, causal=False, sm_scale=0.3,
                                 return_lse=True)
        assert lse.shape == (9, 4) and lse.dtype == np.float32
        stored = lambda x: round_to(dtype_enum(cache_dtype), x)  # noqa: E731
        ref, ref_lse = reference_attention(q, stored(k), stored(v), causal=False, sm_scale=0.3)
        tol = TOLERANCE[cache_dtype]
        assert relative_error(out, ref) <= tol
        assert np.abs(lse - ref_lse).max() <= 10 * tol
        # Attend-only over the cache (num_new_tokens=0), float32 data sent as bfloat16.
        q2 = randn(rng, 2, 4, 64)
        out2 = cache.forward(0, [Span.attend(1, 9, 2)], q2, dtype="bfloat16")
        assert out2.dtype == ml_dtypes.bfloat16
        ref2, _ = reference_attention(round_to(pb.BFLOAT16, q2), stored(k), stored(v))
        assert relative_error(np.asarray(out2, np.float64), ref2) <= max(tol, TOLERANCE["bfloat16"])


def test_rewind_then_rewrite_matches_reference(client, kv_dtypes):
    rng = np.random.default_rng(12)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        k, v = randn(rng, 10, 2, 64), randn(rng, 10, 2, 64)
        cache.forward(0, [Span.prefill(1, 10)], randn(rng, 10, 4, 64), k, v)
        # Rewrite positions 6..8: the sequence is rewound to 6 first (speculative rollback).
        k2, v2, q2 = randn(rng, 3, 2, 64), randn(rng, 3, 2, 64), randn(rng, 3, 4, 64)
        out = cache.forward(0, [Span(1, 6, 3, 3)], q2, k2, v2)
        stored = lambda x: round_to(dtype_enum(kv_dtypes[0]), x)  # noqa: E731
        ref, _ = reference_attention(q2, stored(np.concatenate([k[:6], k2])),
                                     stored(np.concatenate([v[:6], v2])))
        assert relative_error(out, ref) <= TOLERANCE[kv_dtypes[0]]


def test_append_only_forward_takes_no_q(client, kv_dtypes):
    rng = np.random.default_rng(14)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        k, v = randn(rng, 10, 2, 64), randn(rng, 10, 2, 64)
        out = cache.forward(0, [Span(1, 0, 10, 0)], None, k, v)
        assert out.shape == (0, 4, 64)
        q = randn(rng, 1, 4, 64)
        with pytest.raises(errors.InvalidArgument,
                           match=r"q is required: the spans' num_queries total 1 "):
            cache.forward(0, [Span(1, 10, 0, 1)], None)  # a query, but no q
        out = cache.forward(0, [Span(1, 10, 0, 1)], q)
        stored = lambda x: round_to(dtype_enum(kv_dtypes[0]), x)  # noqa: E731
        ref, _ = reference_attention(q, stored(k), stored(v))
        assert relative_error(out, ref) <= TOLERANCE[kv_dtypes[0]]


def test_release_gives_pages_back(client, kv_dtypes):
    rng = np.random.default_rng(13)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        spans = [Span.prefill(1, 9), Span.prefill(2, 4)]  # 3 + 1 pages of 4 tokens
        cache.forward(0, spans, randn(rng, 13, 4, 64), randn(rng, 13, 2, 64), randn(rng, 13, 2, 64))
        assert cache.stats().used_pages == 4
        r = cache.release([1, 2, 99])
        assert (r.released, r.freed_pages, list(r.unknown_seq_ids)) == (2, 4, [99])
        stats = cache.stats()
        assert (stats.used_pages, stats.free_pages, stats.live_sequences) == (0, 16, 0)
        assert stats.forward_calls == 1
        with pytest.raises(TypeError, match=r"^seq_ids is a list of sequence ids \(got int 1: "
                           r"\[1\] would do\)"):
            cache.release(1)


def test_truncate_rewinds_one_layer(client, kv_dtypes):
    rng = np.random.default_rng(15)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        q, k, v = randn(rng, 6, 4, 64), randn(rng, 6, 2, 64), randn(rng, 6, 2, 64)
        for layer in (0, 1):
            cache.forward(layer, [Span.prefill(1, 6)], q, k, v)
        cache.forward(0, [Span.prefill(2, 2)], q[:2], k[:2], v[:2])
        r = cache.truncate(0, {1: 2, 2: 5, 7: 0})  # seq 2 is shorter already; 7 is unknown
        assert (r.truncated, r.freed_pages, list(r.unknown_seq_ids)) == (1, 0, [7])  # layer 1: 6
        # Layer 0 of seq 1 now ends at 2: a token at 3 leaves a gap, one at 2 follows.
        with pytest.raises(errors.FailedPrecondition):
            cache.forward(0, [Span.decode(1, 3)], q[:1], k[:1], v[:1])
        cache.forward(0, [Span.decode(1, 2)], q[:1], k[:1], v[:1])
        cache.truncate(0, [(1, 2)])
        r = cache.truncate(1, [(1, 0)])
        assert (r.truncated, r.freed_pages) == (1, 1)  # 2 tokens left in layer 0: 1 page
        r = cache.truncate(0, [pb.SequenceLength(seq_id=1, length=0), (2, 0)])
        assert (r.truncated, r.freed_pages) == (2, 2)  # both empty everywhere: freed
        stats = cache.stats()
        assert (stats.used_pages, stats.live_sequences) == (0, 0)
        with pytest.raises(errors.InvalidArgument):
            cache.truncate(2, {1: 0})  # no layer 2


def test_big_prefill_over_16_mib_each_way(client, kv_dtypes):
    """520 tokens x 32 heads x 256 f32 = 16.25 MiB of q and of the answer: past gRPC's 4 MiB
    default receive limit, which the client raises to the server's 512 MiB."""
    rng = np.random.default_rng(14)
    n, hq, hkv, d = 520, 32, 8, 256
    cache_dtype = kv_dtypes[0]
    config = CacheConfig(1, hq, hkv, d, page_size=64, kv_dtype=cache_dtype, num_pages=9)
    with client.create_cache(config) as cache:
        q, k, v = randn(rng, n, hq, d), randn(rng, n, hkv, d), randn(rng, n, hkv, d)
        out = cache.forward(0, [Span.prefill(1, n)], q, k, v)
        assert out.nbytes >= 16 << 20
        stored = lambda x: round_to(dtype_enum(cache_dtype), x)  # noqa: E731
        ref, _ = reference_attention(q, stored(k), stored(v))
        assert relative_error(out, ref) <= TOLERANCE[cache_dtype]

        # A plain gRPC channel keeps the 4 MiB default: a 5 MiB answer is refused, and the
        # error maps to ResourceExhausted with both sizes.
        req = pagedattn._common.forward_request(cache, 0, [Span.attend(1, n, 160)], q[-160:],
                                                None, None, None, None, False, None)
        with grpc.insecure_channel(client.target) as ch:
            stub = pagedattn.v1.attention_pb2_grpc.AttentionServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Forward(req, timeout=300)
        err = errors.from_rpc_error(e.value)
        assert isinstance(err, errors.ResourceExhausted)
        assert err.max_message_bytes == 4 << 20 and err.message_bytes > 5 << 20


def test_concurrent_threads_share_one_client(client, kv_dtypes):
    """8 threads, one sequence each: prefill then 6 decode steps, interleaved on one channel."""
    cache_dtype = kv_dtypes[0]
    stored = lambda x: round_to(dtype_enum(cache_dtype), x)  # noqa: E731
    config = CacheConfig(2, 8, 2, 64, page_size=8, kv_dtype=cache_dtype, num_pages=64)

    def run(cache, seq: int) -> float:
        rng = np.random.default_rng(100 + seq)
        n0 = 3 + seq
        k, v = randn(rng, n0, 2, 64), randn(rng, n0, 2, 64)
        q = randn(rng, n0, 8, 64)
        worst = relative_error(cache.forward(seq % 2, [Span.prefill(seq, n0)], q, k, v),
                               reference_attention(q, stored(k), stored(v))[0])
        for step in range(6):
            q1, k1, v1 = randn(rng, 1, 8, 64), randn(rng, 1, 2, 64), randn(rng, 1, 2, 64)
            out = cache.forward(seq % 2, [Span.decode(seq, n0 + step)], q1, k1, v1)
            k, v = np.concatenate([k, k1]), np.concatenate([v, v1])
            worst = max(worst, relative_error(out, reference_attention(q1, stored(k), stored(v))[0]))
        return worst

    with client.create_cache(config) as cache:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            errs = list(pool.map(lambda s: run(cache, s), range(1, 9)))
        assert max(errs) <= TOLERANCE[cache_dtype], errs
        stats = cache.stats()
        assert stats.live_sequences == 8 and stats.forward_calls == 8 * 7
        assert cache.release(range(1, 9)).released == 8
        assert cache.stats().used_pages == 0


# -- torch tensors (optional) ----------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_torch_tensors_in_and_out(client, kv_dtypes, dtype_name):
    torch = pytest.importorskip("torch")
    cache_dtype = kv_dtypes[0]
    tdtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 64, generator=gen).to(tdtype) for n, h in ((6, 4), (6, 2), (6, 2)))
    with client.create_cache(small_config(cache_dtype)) as cache:
        out = cache.forward(0, [Span.prefill(1, 6)], q, k, v)
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and tuple(out.shape) == (6, 4, 64)
    stored = lambda x: round_to(dtype_enum(cache_dtype), x.float().numpy())  # noqa: E731
    ref, _ = reference_attention(q.float().numpy(), stored(k), stored(v))
    tol = max(TOLERANCE[cache_dtype], TOLERANCE[dtype_name])
    assert relative_error(out.float().numpy(), ref) <= tol


# -- the CLI ---------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedattn", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_output_into_a_closed_pipe_is_quiet(target):
    """`python -m pagedattn info | head -0`: the reader gone, the command ends without a word
    (it printed "error: [Errno 32] Broken pipe"), with the status SIGPIPE would give."""
    p = subprocess.Popen([sys.executable, "-m", "pagedattn", f"--target={target}", "info"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # no reader: the command's first write fails
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and err == "", err


def test_cli_help_explains_every_flag():
    """python -m pagedattn --help: every flag with a line of help that gives its default."""
    from pagedattn.__main__ import parser

    p = parser()
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]} has no help text"
        if action.default not in (None, False, ""):
            assert "default" in action.help, f"{action.option_strings[0]}: no default in its help"


def test_cli_info_validate_smoke(target, backend, server_info):
    r = _cli(f"--target={target}", "info")
    assert r.returncode == 0 and f'"backend": "{backend}"' in r.stdout
    r = _cli(f"--target={target}", "health")
    assert (r.returncode, r.stdout.strip()) == (0, "SERVING")
    r = _cli(f"--target={target}", "--num_layers=2", "--num_pages=16", "validate")
    assert r.returncode == 0 and '"valid": true' in r.stdout
    r = _cli(f"--target={target}", "--page_size=0", "--head_dim=100", "validate")
    assert r.returncode == 1 and '"valid": false' in r.stdout
    r = _cli(f"--target={target}", "smoke")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "PASS"
    r = _cli("--target=127.0.0.1:1", "--timeout_s=5", "info")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr
    # An FP8 cache's smoke (within FP8's bound, as pagedattn-cli smoke); usage errors are one
    # line and exit 2, never a traceback.
    r = _cli(f"--target={target}", "--kv_dtype=float8_e4m3", "--head_dim=64", "smoke")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "PASS", r.stdout + r.stderr
    # --layers sends the layers' variants (a window of 0 is the server's refusal, by field).
    r = _cli(f"--target={target}", "--num_layers=2", "--num_pages=16",
             '--layers=[{"sliding_window": 8, "logit_softcap": 30}, {}]', "validate")
    assert r.returncode == 0 and '"slidingWindow": 8' in r.stdout, r.stdout + r.stderr
    r = _cli(f"--target={target}", "--num_layers=2", "--num_pages=16",
             '--layers=[{"sliding_window": 0}]', "validate")
    assert r.returncode == 1 and "layers[0].sliding_window" in r.stdout, r.stdout + r.stderr
    # STATIC scales reach the smoke's cache: they run, and a bad scaling is the server's refusal.
    r = _cli(f"--target={target}", "--kv_dtype=float8_e4m3", "--kv_scaling=static",
             "--kv_scales=0.02,0.01", "smoke")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "PASS", r.stdout + r.stderr
    r = _cli(f"--target={target}", "--kv_scaling=static", "--kv_scales=0.02,0.01", "smoke")
    assert r.returncode == 1 and "kv_scaling applies to FLOAT8_E4M3" in r.stderr, r.stderr
    # --device reaches the smoke's cache: one past the server's last device is refused by name.
    n = server_info.device_count
    r = _cli(f"--target={target}", f"--device={n}", "smoke")
    assert r.returncode == 1 and f"device must be in 0..{n - 1} (got {n})" in r.stderr, r.stderr
    # --layers' variants reach the smoke's cache and its reference (a window shorter than its
    # sequences, a soft-cap, sinks); a layer count or a capacity for smoke is refused below.
    r = _cli(f"--target={target}", "--head_dim=64", '--layers=[{"sliding_window": 7, '
             '"logit_softcap": 5, "sinks": [0, 1, 2, 3, -1, -2, 0.5, 1.5]}, {}]', "smoke")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "PASS", r.stdout + r.stderr
    assert "layer 0: window 7, soft-cap 5, 8 sinks" in r.stdout and "layer 1: plain" in r.stdout
    # Page size 1 (the smoke's cache has the pages its steps need at any page size).
    r = _cli(f"--target={target}", "--page_size=1", "smoke")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "PASS", r.stdout + r.stderr
    for args, says in ((["--q_dtype=fp8", "smoke"], "q_dtype must be float32, float16 or bfloat16"),
                       (["--num_layers=4", "smoke"], "--num_layers is validate's"),
                       (["--max_bytes=9999", "smoke"], "--max_bytes is validate's"),
                       (["--layers=[{}, {}, {}]", "smoke"], "the smoke cache has 2 layers"),
                       (["--tls_ca=/nonexistent/ca.pem", "info"],
                        "--tls_ca /nonexistent/ca.pem: cannot read the file (no such file)"),
                       (["--tls_cert=/nonexistent/c.pem", "--tls_key=/etc/hostname", "info"],
                        "--tls_cert /nonexistent/c.pem: cannot read the file"),
                       (["--tls_key=/x.key", "info"], "--tls_key needs --tls_cert"),
                       (["--tls_server_name=x", "info"], "--tls_server_name applies to TLS"),
                       (["--tls_ca=/etc/hostname", "info"], "holds no PEM"),
                       (["--kv_scales=a,1", "validate"], "--kv_scales must be numbers"),
                       (["--kv_dtype=fp9", "validate"], "--kv_dtype must be float32, float16, "
                        "bfloat16 or float8_e4m3 (got 'fp9')"),
                       (["--q_dtype=int8", "smoke"], "--q_dtype must be float32, float16 or "
                        "bfloat16 (got 'int8')"),
                       (["--kv_scaling=per-token", "validate"], "--kv_scaling must be PER_TOKEN "
                        "or STATIC (got 'per-token')"),
                       (["--layers=[{\"window\": 1}]", "validate"], "--layers must be a JSON array"),
                       (["--num_pages=9", "--seed=2", "list"], "--num_pages is for validate, "
                        "smoke, not list; --seed is for smoke, not list"),
                       (["--q_dtype=float16", "validate"], "--q_dtype is for smoke, not validate"),
                       (["--kv_dtype=float8_e4m3", "--kv_scaling=static", "--kv_scales=1e-50,1",
                         "validate"], "kv_scales[0] is 1e-50, outside float32's range")):
        r = _cli(f"--target={target}", *args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_raw_protos_and_deadline(client, kv_dtypes):
    rng = np.random.default_rng(15)
    with client.create_cache(small_config(kv_dtypes[0])) as cache:
        q, k, v = randn(rng, 3, 4, 64), randn(rng, 3, 2, 64), randn(rng, 3, 2, 64)
        req = pb.ForwardRequest(cache_id=cache.cache_id, layer=1, spans=[Span.prefill(4, 3).to_proto()],
                                q=pagedattn.to_tensor(q), k=pagedattn.to_tensor(k),
                                v=pagedattn.to_tensor(v))
        req.options.return_lse = True
        resp = client.forward_raw(req)
        assert list(resp.out.shape) == [3, 4, 64] and list(resp.lse.shape) == [3, 4]
        stored = lambda x: round_to(dtype_enum(kv_dtypes[0]), x)  # noqa: E731
        ref, _ = reference_attention(q, stored(k), stored(v))
        assert relative_error(pagedattn.to_numpy(resp.out), ref) <= TOLERANCE[kv_dtypes[0]]
        assert cache.refresh().stats.forward_calls == 1
        # 32 MiB cannot even be sent within 1 ms (a local unary call can finish within one).
        big = np.zeros((8192, 8, 128), np.float32)
        with pytest.raises(errors.DeadlineExceeded) as e:
            client.forward(cache, 0, [Span.attend(4, 3, 8192)], big, timeout=1e-3)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_layer_attention_variants_round_trip(client):
    """A Gemma-style table (windowed + global layers, soft-cap, sinks) on either backend: the
    server echoes it; a bad entry is refused at create_cache, naming the field."""
    layers = (pagedattn.LayerAttention(sliding_window=4, logit_softcap=30.0),
              pagedattn.LayerAttention(logit_softcap=30.0, sinks=(0.5,) * 4))
    config = pagedattn.CacheConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                   page_size=16, kv_dtype="bfloat16", num_pages=16, layers=layers)
    with client.create_cache(config) as cache:
        assert pagedattn.CacheConfig.from_proto(cache.config).layers == layers
        caps = client.server_info().capabilities
        assert caps.supports_sliding_window and caps.supports_logit_softcap and caps.supports_sinks
    # Sinks given as an array are kept as a tuple: the entry hashes and compares as a value.
    as_array = pagedattn.LayerAttention(logit_softcap=30.0, sinks=np.full(4, 0.5, np.float32))
    assert as_array == layers[1] and hash(as_array) == hash(layers[1])
    bad = dataclasses.replace(config, layers=(pagedattn.LayerAttention(sliding_window=0),) * 2)
    with pytest.raises(pagedattn.CacheConfigError, match=r"layers\[0\]\.sliding_window"):
        client.create_cache(bad)


def test_fp8_cache_config(client, kv_dtypes):
    """FLOAT8_E4M3 caches: PER_TOKEN scaling by default, echoed with the bytes a token takes;
    STATIC needs its scales (never a silent 1.0); a backend without FP8 names kv_dtype; FP8 is
    never a tensor's dtype."""
    config = pagedattn.CacheConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                   page_size=16, kv_dtype="float8_e4m3", num_pages=16)
    if "float8_e4m3" not in kv_dtypes:
        with pytest.raises(pagedattn.CacheConfigError, match="kv_dtype"):
            client.create_cache(config)
        return
    with client.create_cache(config) as cache:
        echoed = pagedattn.CacheConfig.from_proto(cache.config)
        assert (echoed.kv_dtype, echoed.kv_scaling) == ("float8_e4m3", "per_token")
        assert cache.info.bytes_per_token == 2 * 2 * 2 * (64 + 4)  # K, V x layers x heads
    static = dataclasses.replace(config, kv_scaling="static")
    with pytest.raises(pagedattn.CacheConfigError, match="kv_scales"):
        client.create_cache(static)
    with client.create_cache(dataclasses.replace(static, kv_scales=(0.02, 0.01))) as cache:
        assert tuple(cache.config.kv_scales) == pytest.approx((0.02, 0.01) * 2)
        assert cache.info.bytes_per_token == 2 * 2 * 2 * 64
    with pytest.raises(TypeError, match="float8_e4m3 is a cache's kv_dtype"):
        pagedattn.tensors.to_tensor(np.zeros((1, 4, 64), np.float32), "float8_e4m3")
    # kv_scaling as a name (any case) or the proto's enum value, like kv_dtype; anything else
    # is an error naming the field.
    assert dataclasses.replace(static, kv_scaling="STATIC").to_proto().kv_scaling == pb.STATIC
    assert dataclasses.replace(static, kv_scaling=pb.STATIC).to_proto().kv_scaling == pb.STATIC
    for bad, error in ((2.0, TypeError), (True, TypeError), (7, ValueError), ("fixed", ValueError)):
        with pytest.raises(error, match=r"^CacheConfig.kv_scaling must be 'per_token' or "
                           r"'static'.*\(got " + re.escape(repr(bad)) + r"\)"):
            dataclasses.replace(static, kv_scaling=bad).to_proto()


@contextlib.contextmanager
def _long_forward(server, n: int, seed: int, under_way_s: float = 0.3):
    """A prefill of n tokens (8 heads of 128, float32: seconds on one CPU thread) running on
    `server`; yields (q, the future of its answer), once it has been under way for under_way_s
    (its request, 12n KiB, must have reached the server by then: on a loaded host 0.3 s was
    not always enough for 4096 tokens' 48 MiB)."""
    config = CacheConfig(num_layers=1, num_q_heads=8, num_kv_heads=8, head_dim=128,
                         page_size=16, kv_dtype="float32", num_pages=n // 16)
    q = np.random.default_rng(seed).standard_normal((n, 8, 128), dtype=np.float32)
    with pagedattn.Client(server.target, timeout=120) as c:
        cache = c.create_cache(config, delete_on_exit=False)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(cache.forward, 0, [Span.prefill(1, n)], q, q, q)
            time.sleep(under_way_s)
            assert not answer.done()
            yield q, answer


def test_a_forward_in_flight_at_sigterm_gets_its_answer(start_servers, backend):
    """SIGTERM while a Forward with a large answer runs: it finishes inside --shutdown_grace_s
    and its answer reaches the client (the server waits for the answer to go out, not only for
    the handler to return), then the server exits 0."""
    if backend != "cpu":
        pytest.skip("timed for the CPU backend's speed")
    (server,) = start_servers(1, "--shutdown_grace_s=60")  # one CPU thread, as every test server
    # Seconds of work, a 12 MiB answer; 1 s for its 36 MiB request to be in (0.3 s was not
    # always enough on a loaded host: the SIGTERM came first and refused the call).
    with _long_forward(server, 3072, 3, under_way_s=1.0) as (q, answer):
        server.proc.send_signal(signal.SIGTERM)
        out = answer.result()
    assert out.shape == q.shape and np.isfinite(out).all()
    assert server.stop() == 0


def test_a_second_signal_stops_the_calls_in_flight(start_servers, backend):
    """SIGTERM, then SIGINT during the grace period (Ctrl-C twice): the Forward in flight is
    stopped at once and the server exits 0 long before the 60 s grace ends."""
    if backend != "cpu":
        pytest.skip("timed for the CPU backend's speed")
    (server,) = start_servers(1, "--shutdown_grace_s=60")
    with _long_forward(server, 4096, 4, under_way_s=1.5) as (_, answer):  # several seconds
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_for_log("received SIGTERM: "), server.log  # the second comes second
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        with pytest.raises(errors.Unavailable, match="stopped the call before it finished"):
            answer.result()  # a retry on another replica would work
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
    assert "received SIGINT again: calls in flight are stopped now" in server.log


def test_limits_are_logged_at_info_and_throttled(start_servers):
    """A refusal an operator may act on (here out of pages) is an info line naming the call and
    the cache, at most one a second for each method and code, with the count held back."""
    (server,) = start_servers(1)
    config = CacheConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=4,
                         num_pages=4)
    q, kv = np.zeros((12, 2, 64), np.float32), np.zeros((12, 1, 64), np.float32)
    with pagedattn.Client(server.target) as c, c.create_cache(config) as cache:
        cache.forward(0, [Span.prefill(1, 12)], q, kv, kv)  # 3 of the 4 pages
        for _ in range(3):
            with pytest.raises(errors.OutOfPages):
                cache.forward(0, [Span.prefill(2, 8)], q[:8], kv[:8], kv[:8])
        time.sleep(1.1)
        with pytest.raises(errors.OutOfPages):
            cache.forward(0, [Span.prefill(2, 8)], q[:8], kv[:8], kv[:8])
        cache_id = cache.cache_id
    lines = [line for line in server.log.splitlines() if "RESOURCE_EXHAUSTED" in line]
    assert all(" info " in line and f"rpc Forward cache={cache_id}" in line and
               "out of KV pages" in line for line in lines), lines
    # The 2 held back are counted by the next line, or by a line of their own a second after the
    # first when none came by then (whichever the server got to first).
    if len(lines) == 2:
        assert lines[1].endswith("(and 2 more like it)"), lines
    else:
        assert len(lines) == 3 and "2 more held back in the last " in lines[1], lines


def test_a_burst_of_refusals_is_counted_once_it_ends(start_servers):
    """A burst of refusals shorter than a second (a client retrying in a loop) is one line and
    then, a second later, a line that counts the rest: without it the count waited for the next
    refusal, and a burst that ended left one line for any number of refusals."""
    (server,) = start_servers(1)
    config = CacheConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=4,
                         num_pages=1)
    q, kv = np.zeros((8, 2, 64), np.float32), np.zeros((8, 1, 64), np.float32)
    with pagedattn.Client(server.target) as c, c.create_cache(config) as cache:
        for _ in range(25):
            with pytest.raises(errors.ResourceExhausted):
                cache.forward(0, [Span.prefill(1, 8)], q, kv, kv)
        server.wait_for_log("more held back in the last ", timeout_s=10)
    lines = [line for line in server.log.splitlines() if "RESOURCE_EXHAUSTED" in line]
    flushed = [line for line in lines if " more held back in the last " in line]
    assert flushed and f"like it: rpc Forward cache={cache.cache_id}" in flushed[-1], lines
    # Every refusal is in the log: as a line of its own or in a count (25 calls take well
    # under a second, but a slow machine may spread them over two).
    told = 0
    for line in lines:
        held = re.search(r" info (\d+) more held back in the last ", line)
        more = re.search(r"\(and (\d+) more like it\)$", line)
        told += int(held.group(1)) if held else 1 + (int(more.group(1)) if more else 0)
    assert told == 25, lines


def test_request_id_reaches_the_server_log(start_servers):
    """pagedattn.request_id(...): each call made in it, sync, asyncio, a Step stream and each
    shard of a sharded cache, carries the id, and the server's log line for the call shows it;
    calls outside it carry none. Bad ids are refused before any call."""
    import asyncio

    import pagedattn.aio

    servers = start_servers(2, "--log_level=debug")
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         kv_dtype="bfloat16", num_pages=16)
    q = np.random.randn(1, 4, 64).astype(np.float32)
    k = v = np.random.randn(1, 2, 64).astype(np.float32)
    with pagedattn.Client(servers[0].target) as c, c.create_cache(config) as cache:
        with pagedattn.request_id("sync-1"):
            cache.forward(0, [Span.prefill(seq_id=1, num_tokens=1)], q, k, v)
            with pagedattn.request_id("inner-2"):  # nests
                c.get_cache(cache)
            with cache.step([Span.decode(seq_id=1, position=1)]) as step:
                step.forward(0, q, k, v)
        c.list_caches()  # none

        async def aio_call() -> None:
            async with pagedattn.aio.Client(servers[0].target) as ac:
                with pagedattn.request_id("aio-3"):
                    await ac.get_cache(cache.cache_id)

        asyncio.run(aio_call())
    with pagedattn.ShardedClient([s.target for s in servers]) as sc:
        with sc.create_cache(config) as sharded, pagedattn.request_id("shard-4"):
            sharded.forward(0, [Span.prefill(seq_id=1, num_tokens=1)], q, k, v)

    def lines(log: str, needle: str) -> list[str]:
        return [line for line in log.splitlines() if needle in line]

    deadline = time.monotonic() + 10  # the log is read by a thread
    want = [(0, "rpc Forward ", "req=sync-1"), (0, "rpc GetCache ", "req=inner-2"),
            (0, "rpc Step ", "req=sync-1"), (0, "rpc GetCache ", "req=aio-3"),
            (0, "rpc Forward ", "req=shard-4"), (1, "rpc Forward ", "req=shard-4")]
    while time.monotonic() < deadline and not all(
            any(rid in line for line in lines(servers[i].log, what)) for i, what, rid in want):
        time.sleep(0.05)
    for i, what, rid in want:
        assert any(rid in line for line in lines(servers[i].log, what)), (
            f"no {what!r} line with {rid!r} on server {i}:\n{servers[i].log}")
    listed = lines(servers[0].log, "rpc ListCaches ")
    assert listed and all("req=" not in line for line in listed), listed

    for bad in ("", "a\nb", "caf\u00e9", 7, "r" * 257):
        with pytest.raises(ValueError, match="request_id"):
            with pagedattn.request_id(bad):
                pass
    with pagedattn.Client(servers[0].target) as c, pagedattn.request_id("r" * 256):  # the longest
        assert isinstance(c.list_caches(), list)
