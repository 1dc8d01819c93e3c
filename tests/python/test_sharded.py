"""pagedattn.ShardedClient: a cache split by KV head over N servers answers exactly what one
server holding the whole cache answers (bit for bit on the CPU backend); its config is checked
whole and on each shard; a Forward that fails on one shard is rolled back on the others (out of
pages, a killed server); and the asyncio twin."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import warnings

import grpc
import ml_dtypes
import numpy as np
import pytest

import pagedattn
import pagedattn.aio
from pagedattn import CacheConfig, Span, errors
from pagedattn.reference import relative_error

NUMPY_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def randn(rng: np.random.Generator, *shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def qkv(rng, tokens: int, queries: int, hq: int, hkv: int, dtype=np.float32, head_dim: int = 64):
    return (randn(rng, queries, hq, head_dim, dtype=dtype),
            randn(rng, tokens, hkv, head_dim, dtype=dtype),
            randn(rng, tokens, hkv, head_dim, dtype=dtype))


# Bit for bit on the CPU backend. The CUDA backend splits a sequence's KV over more blocks when a
# launch has fewer heads to fill the GPU with, so a shard's sums may be ordered otherwise there:
# equal up to rounding.
EXACT = {"cpu": True}
CLOSE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}


@pytest.fixture(autouse=True)
def _exactness(request):
    if "client" in request.fixturenames:
        EXACT["now"] = request.getfixturevalue("backend") == "cpu"
    yield
    EXACT.pop("now", None)


def same_bits(a, b) -> None:
    """Identical dtype, shape and bytes (not merely close); on CUDA, equal up to rounding."""
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            same_bits(x, y)
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if not EXACT.get("now", True):
        tol = CLOSE.get(str(a.dtype), 1e-5)
        assert relative_error(np.asarray(b, np.float32), np.asarray(a, np.float32)) <= tol
        return
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert a.tobytes() == b.tobytes(), f"max |diff| {diff.max()}"


def both(ref, sharded, layer, spans, q, k=None, v=None, **kw):
    """The same Forward on the reference cache and the sharded one: the answers, bit for bit."""
    want = ref.forward(layer, spans, q, k, v, **kw)
    got = sharded.forward(layer, spans, q, k, v, **kw)
    same_bits(want, got)
    return got


def pages_and_sequences(stats) -> tuple[int, int, int]:
    return stats.used_pages, stats.free_pages, stats.live_sequences


@pytest.fixture
def shard_targets(shard_servers) -> list[str]:
    return [s.target for s in shard_servers]


# -- the answers -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [(8, 4), (16, 4)], ids=["8q4kv", "16q4kv"])
@pytest.mark.parametrize("n", [2, 4])
def test_bit_identical_to_one_server(client, shard_targets, kv_dtypes, n, heads, kv_dtype):
    if kv_dtype not in kv_dtypes:
        pytest.skip(f"{kv_dtype} caches are not supported by this backend")
    hq, hkv = heads
    dt = NUMPY_DTYPE[kv_dtype]
    rng = np.random.default_rng(n * 100 + hq)
    config = CacheConfig(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=4,
                         kv_dtype=kv_dtype, num_pages=64)
    with pagedattn.ShardedClient(shard_targets[:n]) as sc:
        with client.create_cache(config) as ref, sc.create_cache(config, name="bits") as sh:
            assert sh.num_shards == n and sh.targets == shard_targets[:n]
            assert pagedattn.CacheConfig.from_proto(sh.config) == config
            for i, shard in enumerate(sh.shards):
                assert (shard.config.num_q_heads, shard.config.num_kv_heads) == (hq // n, hkv // n)
                assert shard.info.name == f"bits [shard {i}/{n}]"
                assert sh.q_heads(i) == range(i * hq // n, (i + 1) * hq // n)
            for layer in (0, 1):
                # prefill of two sequences in one call
                both(ref, sh, layer, [Span.prefill(1, 7), Span.prefill(2, 5)],
                     *qkv(rng, 12, 12, hq, hkv, dt))
                # decode, with the log-sum-exp
                out, lse = both(ref, sh, layer, [Span.decode(1, 7), Span.decode(2, 5)],
                                *qkv(rng, 2, 2, hq, hkv, dt), return_lse=True)
                assert out.shape == (2, hq, 64) and out.dtype == dt and lse.shape == (2, hq)
            # mixed: a prefill, a decode, attention over the cache alone, a prefill with fewer
            # queries than tokens
            mixed = [Span.prefill(3, 6), Span.decode(1, 8), Span.attend(2, 6, 2), Span(4, 0, 5, 2)]
            both(ref, sh, 0, mixed, *qkv(rng, 6 + 1 + 5, 6 + 1 + 2 + 2, hq, hkv, dt),
                 return_lse=True)
            # rewind: seq 1 (9 tokens) written again from position 4; seq 3 decodes
            both(ref, sh, 0, [Span(1, 4, 3, 3), Span.decode(3, 6)], *qkv(rng, 4, 4, hq, hkv, dt))
            # non-causal, a custom scale, attention over the cache alone (no k/v)
            q = randn(rng, 5, hq, 64, dtype=dt)
            both(ref, sh, 0, [Span.attend(1, 7, 3), Span.attend(4, 5, 2)], q, causal=False,
                 sm_scale=0.3, return_lse=True)
            # the sharded cache holds what the whole one holds, on every shard
            want = pages_and_sequences(ref.stats())
            assert [pages_and_sequences(s) for s in sh.stats()] == [want] * n
            assert [r.released for r in sh.release([1, 2, 3, 4])] == [4] * n
            ref.release([1, 2, 3, 4])
            want = pages_and_sequences(ref.stats())
            assert [pages_and_sequences(s) for s in sh.stats()] == [want] * n
            ids = sh.cache_ids
        assert sh.deleted
        for c, cache_id in zip(sc.clients, ids):
            with pytest.raises(errors.NotFound):
                c.get_cache(cache_id)


def test_layer_variants_shard_with_their_heads(client, shard_targets):
    """A layer's sinks are per q head: each shard gets its heads' (and the whole config shows
    them all again); windows and caps go to every shard; answers bit for bit as one server's."""
    hq, hkv, n = 8, 4, 2
    rng = np.random.default_rng(7)
    sinks = tuple(0.5 * h - 1.0 for h in range(hq))
    layers = (pagedattn.LayerAttention(sliding_window=3, logit_softcap=5.0, sinks=sinks),
              pagedattn.LayerAttention())
    config = CacheConfig(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=64, layers=layers)
    with pagedattn.ShardedClient(shard_targets[:n]) as sc:
        with client.create_cache(config) as ref, sc.create_cache(config, name="variants") as sh:
            for i, shard in enumerate(sh.shards):
                assert tuple(shard.config.layers[0].sinks) == sinks[i * hq // n:(i + 1) * hq // n]
                assert shard.config.layers[0].sliding_window == 3
            assert pagedattn.CacheConfig.from_proto(sh.config).layers == layers
            for layer in (0, 1):
                both(ref, sh, layer, [Span.prefill(1, 7), Span.prefill(2, 5)],
                     *qkv(rng, 12, 12, hq, hkv, NUMPY_DTYPE["bfloat16"]), return_lse=True)
                both(ref, sh, layer, [Span.decode(1, 7), Span.decode(2, 5)],
                     *qkv(rng, 2, 2, hq, hkv, NUMPY_DTYPE["bfloat16"]), return_lse=True)
            # Append only: no q (None) on either.
            _, k, v = qkv(rng, 3, 0, hq, hkv, NUMPY_DTYPE["bfloat16"])
            out = both(ref, sh, 0, [Span(1, 8, 3, 0)], None, k, v)
            assert out.shape == (0, hq, 64)


def test_torch_tensors_and_wire_dtype(client, shard_targets):
    torch = pytest.importorskip("torch")
    config = CacheConfig(num_layers=1, num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 64, generator=g) for h in (8, 4, 4))
    with pagedattn.ShardedClient(shard_targets[:2]) as sc, client.create_cache(config) as ref, \
            sc.create_cache(config) as sh:
        want = ref.forward(0, [Span.prefill(1, 6)], q, k, v, dtype="bfloat16")
        got = sh.forward(0, [Span.prefill(1, 6)], q, k, v, dtype="bfloat16")
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
        if EXACT["now"]:
            assert torch.equal(want, got)
        else:
            assert relative_error(got.float().numpy(), want.float().numpy()) <= 1e-2


def test_heads_are_checked_before_sending(shard_targets):
    config = CacheConfig(num_layers=1, num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=16)
    rng = np.random.default_rng(0)
    with pagedattn.ShardedClient(shard_targets[:2]) as sc, sc.create_cache(config) as sh:
        # 16 q heads: split in two they would look right to each shard. Each shape is named as
        # the whole cache's, not as a shard's part of it.
        with pytest.raises(errors.InvalidArgument) as e:
            sh.forward(0, [Span.prefill(1, 3)], *qkv(rng, 3, 3, 16, 4))
        assert e.value.message == ("q.shape must be [3, 8, 64] = [total_queries, num_q_heads, "
                                   "head_dim] (got [3, 16, 64])")
        with pytest.raises(errors.InvalidArgument) as e:
            sh.forward(0, [Span.prefill(1, 3)], *qkv(rng, 3, 3, 8, 2))
        assert e.value.message == ("k.shape must be [3, 4, 64] = [total_new_tokens, "
                                   "num_kv_heads, head_dim] (got [3, 2, 64])")
        with pytest.raises(errors.InvalidArgument, match=r"q.shape must be \[3, 8, 64\].*got \[4, 8, 64\]"):
            sh.forward(0, [Span.prefill(1, 3)], randn(rng, 4, 8, 64), *qkv(rng, 3, 3, 8, 4)[1:])
        with pytest.raises(errors.InvalidArgument, match=r"v.shape must be \[3, 4, 64\].*got \[3, 4, 32\]"):
            q, k, _ = qkv(rng, 3, 3, 8, 4)
            sh.forward(0, [Span.prefill(1, 3)], q, k, randn(rng, 3, 4, 32))
        assert [s.forward_calls for s in sh.stats()] == [0, 0]


def test_sinks_are_counted_for_the_whole_cache(shard_targets):
    # 3 sinks for 4 q heads: each shard's server would be told its own 2 heads' count.
    config = CacheConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                         num_pages=16, layers=[pagedattn.LayerAttention(),
                                               pagedattn.LayerAttention(sinks=[0.5, 1.0, 2.0])])
    with pagedattn.ShardedClient(shard_targets[:2]) as sc:
        with pytest.raises(errors.CacheConfigError) as e:
            sc.create_cache(config)
    assert e.value.violations == [
        ("layers[1].sinks", "sinks must have num_q_heads=4 values, one per q head (got 3)")]


def test_a_call_refused_by_the_client_rolls_nothing_back(shard_targets):
    # The rewriting span's request is over the client's own message limit on every shard: it is
    # never sent, so nothing is truncated (a rollback to the span's start would drop tokens
    # 10..99 that every shard holds).
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         num_pages=64)
    rng = np.random.default_rng(5)
    with pagedattn.ShardedClient(shard_targets[:2], max_message_bytes=200_000) as sc, \
            sc.create_cache(config) as sh:
        sh.forward(0, [Span.prefill(1, 100)], *qkv(rng, 100, 100, 4, 2))
        with pytest.raises(errors.ResourceExhausted) as e:
            sh.forward(0, [Span.prefill(1, 400, start=10)], *qkv(rng, 400, 400, 4, 2))
        assert "no shard wrote anything" in e.value.message and e.value.rolled_back == []
        # Still 100 tokens on both: attending at position 100 leaves no gap.
        sh.forward(0, [Span(1, 100, 0, 1)], randn(rng, 1, 4, 64))
        # A bad timeout is refused before any shard is sent the call.
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            sh.forward(0, [Span.decode(1, 100)], *qkv(rng, 1, 1, 4, 2), timeout=0)
        assert [s.forward_calls for s in sh.stats()] == [2, 2]


def test_a_call_refused_by_the_servers_message_limit_rolls_nothing_back(start_servers):
    # Every shard's server refuses the rewriting span's request for its size (gRPC's receive
    # limit, "Received message larger than max" with the server's limit, not this client's):
    # nothing was written, so nothing is truncated (tokens 10..99 stay on every shard).
    servers = start_servers(2, "--max_message_mb=1")
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         num_pages=256)
    rng = np.random.default_rng(6)
    with pagedattn.ShardedClient([s.target for s in servers]) as sc, sc.create_cache(config) as sh:
        sh.forward(0, [Span.prefill(1, 100)], *qkv(rng, 100, 100, 4, 2))
        with pytest.raises(errors.ResourceExhausted) as e:
            sh.forward(0, [Span.prefill(1, 1500, start=10)], *qkv(rng, 1500, 1500, 4, 2))
        assert e.value.rolled_back == [], e.value
        sh.forward(0, [Span(1, 100, 0, 1)], randn(rng, 1, 4, 64))  # still 100 tokens: no gap


def test_a_shard_whose_cache_is_gone_counts_as_deleted(shard_targets):
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         num_pages=8)
    with pagedattn.ShardedClient(shard_targets[:2]) as sc:
        sh = sc.create_cache(config)
        sc.clients[1].delete_cache(sh.cache_ids[1])  # as a restarted server would have lost it
        sh.delete()
        assert sh.deleted
        assert sh.cache_ids[0] not in [c.cache_id for c in sc.clients[0].list_caches()]
        assert sh.delete() == 0  # deleted already: nothing is sent again
        # Shard i's cache is shard i's client's: shards in another order would send each id to
        # another server, whose NOT_FOUND reads as "deleted already".
        with sc.create_cache(config) as made:
            with pytest.raises(ValueError, match="shard i of ShardedClient"):
                pagedattn.ShardedCache(sc, made.shards[::-1])


def test_a_cancelled_aio_forward_rolls_every_shard_back(start_servers):
    import signal
    import threading

    servers = start_servers(2)
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                         num_pages=16)
    rng = np.random.default_rng(9)

    async def run():
        async with pagedattn.aio.ShardedClient([s.target for s in servers], timeout=30) as sc:
            sh = await sc.create_cache(config)
            await sh.forward(0, [Span.prefill(1, 8)], *qkv(rng, 8, 8, 4, 2))
            # Shard 1 stops answering; shard 0 writes the 4 tokens; the caller gives up.
            servers[1].proc.send_signal(signal.SIGSTOP)
            resume = threading.Timer(1.0, servers[1].proc.send_signal, (signal.SIGCONT,))
            resume.start()
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        sh.forward(0, [Span.prefill(1, 4, start=8)], *qkv(rng, 4, 4, 4, 2)), 0.3)
            finally:
                resume.join()
            # Both shards hold 8 tokens again, as a gap after them says (shard 0 had 12).
            for shard in sh.shards:
                with pytest.raises(errors.FailedPrecondition, match="the sequence has 8 tokens"):
                    await shard.forward(0, [Span(1, 9, 0, 1)], randn(rng, 1, 2, 64))
            await sh.delete()

    asyncio.run(run())


# -- the config ------------------------------------------------------------------------------


def test_kv_heads_must_divide_by_the_shard_count(shard_targets):
    config = CacheConfig(num_layers=1, num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=16)
    with pagedattn.ShardedClient(shard_targets[:3]) as sc:
        before = [len(c.list_caches()) for c in sc.clients]
        with pytest.raises(errors.CacheConfigError) as e:
            sc.create_cache(config)
        assert e.value.fields == ["num_kv_heads"]
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        why = e.value.violations[0][1]
        assert "divisible by the number of shards, 3" in why and "got 4" in why
        assert "shard counts that divide it: 1, 2, 4" in why
        assert str(e.value).startswith("INVALID_ARGUMENT: invalid cache config for 3 shards")
        with pytest.raises(errors.CacheConfigError) as e:
            sc.validate(config)
        assert e.value.fields == ["num_kv_heads"]
        assert [len(c.list_caches()) for c in sc.clients] == before


def test_invalid_config_names_each_shard(shard_targets):
    bad = CacheConfig(num_layers=1, num_q_heads=8, num_kv_heads=4, head_dim=100, page_size=4,
                      kv_dtype="bfloat16", num_pages=16)
    with pagedattn.ShardedClient(shard_targets[:2]) as sc:
        with pytest.raises(errors.CacheConfigError) as e:
            sc.create_cache(bad)
        err = e.value
        assert err.fields == ["head_dim", "head_dim"] and err.shards == [0, 1]
        for i, (field, why) in enumerate(err.violations):
            assert why.startswith(f"shard {i} ({shard_targets[i]}): ")
        assert err.message.startswith(f"invalid cache config on shards 0 ({shard_targets[0]}), "
                                      f"1 ({shard_targets[1]}) of 2 (2 violations): head_dim: ")
        assert [r.valid for r in sc.validate(bad)] == [False, False]


def test_config_invalid_on_one_shard_or_create_failing_on_one(client, start_servers):
    """A shard with a 1 MiB pool budget and room for one cache: its violation names it alone;
    a CreateCache it refuses deletes the cache created on the other shard."""
    (small,) = start_servers(1, "--max_total_pool_gb=0.001", "--max_caches_per_tenant=1")
    with pagedattn.ShardedClient([client, small.target]) as sc:
        targets = sc.targets
        before = len(client.list_caches())
        # 128 pages x 2 (K, V) x 2 layers x 2 kv heads x 16 tokens x 64 x 2 bytes = 2 MiB a shard
        big = CacheConfig(num_layers=2, num_q_heads=4, num_kv_heads=4, head_dim=64, page_size=16,
                          kv_dtype="bfloat16", num_pages=128)
        with pytest.raises(errors.CacheConfigError) as e:
            sc.create_cache(big)
        err = e.value
        assert (err.shard, err.target, err.shards) == (1, targets[1], [1])
        assert err.fields == ["num_pages"]
        assert err.violations[0][1].startswith(f"shard 1 ({targets[1]}): ")
        assert "--max_total_pool_gb" in err.violations[0][1]
        assert f"on shard 1 ({targets[1]}) of 2" in err.message and "shard 0" not in err.message
        assert len(client.list_caches()) == before

        small_config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                   page_size=4, kv_dtype="bfloat16", num_pages=4)
        with sc.clients[1].create_cache(small_config):  # its one cache
            with pytest.raises(errors.ResourceExhausted) as e:
                sc.create_cache(small_config)
            err = e.value
            assert not isinstance(err, errors.CacheConfigError)
            assert (err.shard, err.target, err.reason) == (1, targets[1], "TOO_MANY_CACHES")
            assert err.max_caches == 1
            assert f"shard 1 ({targets[1]}) of 2 failed in CreateCache" in err.message
            assert "deleted the cache created on shard 0" in err.message
            assert isinstance(err.__cause__, errors.ResourceExhausted)
            assert len(client.list_caches()) == before
            assert len(sc.clients[1].list_caches()) == 1


def test_max_bytes_too_small_says_the_values_are_a_shards(shard_targets):
    """Each shard judges its 1/N of max_bytes: its suggestion is a shard's, and the error says
    so (taken as the whole cache's, it failed again)."""
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         kv_dtype="bfloat16", max_bytes=1000)
    with pagedattn.ShardedClient(shard_targets[:2]) as sc:
        with pytest.raises(errors.CacheConfigError) as e:
            sc.create_cache(config)
        assert e.value.fields == ["max_bytes", "max_bytes"]
        assert ("the values are a shard's: each takes 1/2 of the cache's max_bytes, so the "
                "cache's are 2 times them") in e.value.message
        # one page a shard: 2 (K, V) x 16 tokens x 64 x 2 bytes = 4096; the cache's twice that
        cache = sc.create_cache(dataclasses.replace(config, max_bytes=2 * 4096))
        assert [s.info.num_pages for s in cache.shards] == [1, 1]
        cache.delete()


# -- failures --------------------------------------------------------------------------------


def test_out_of_pages_on_one_shard_rolls_back_the_others(client, shard_targets):
    hq, hkv = 8, 4
    config = CacheConfig(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=8)
    rng = np.random.default_rng(7)
    with pagedattn.ShardedClient(shard_targets[:2]) as sc, client.create_cache(config) as ref, \
            sc.create_cache(config) as sh:
        for layer in (0, 1):
            both(ref, sh, layer, [Span.prefill(1, 12)], *qkv(rng, 12, 12, hq, hkv))  # 3 pages
        # Shard 1 alone gets a sequence of 5 pages more: it is full, shard 0 has 5 pages free.
        sh.shards[1].forward(0, [Span.prefill(999, 20)], *qkv(rng, 20, 20, hq // 2, hkv // 2))
        before = [pages_and_sequences(s) for s in sh.stats()]
        assert before == [(3, 5, 1), (8, 0, 2)]

        # layer 1: seq 1 decodes (a 4th page), seq 2 is new (2 pages): shard 1 has no page
        failing = ([Span.decode(1, 12), Span.prefill(2, 6)], *qkv(rng, 7, 7, hq, hkv))
        with pytest.raises(errors.OutOfPages) as e:
            sh.forward(1, *failing)
        err = e.value
        assert (err.shard, err.target) == (1, shard_targets[1])
        assert (err.pages_needed, err.free_pages, err.total_pages) == (3, 0, 8)  # shard 1's
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "OUT_OF_PAGES"
        assert str(err).startswith(f"RESOURCE_EXHAUSTED: shard 1 ({shard_targets[1]}) of 2 failed "
                                   "in Forward: out of KV pages")
        assert "rolled back" in err.message and "NOT" not in err.message
        assert err.rolled_back == [0, 1] and err.rollback_errors == {}
        assert list(err.shard_errors) == [1]
        assert err.original is err.__cause__ and isinstance(err.original, errors.OutOfPages)
        assert "shard" not in err.original.message

        # Every shard is as before, and answers as the reference that never saw the call.
        assert [pages_and_sequences(s) for s in sh.stats()] == before
        for layer in (0, 1):
            both(ref, sh, layer, [Span.attend(1, 12, 3)], randn(rng, 3, hq, 64))
        with pytest.raises(errors.NotFound) as e:  # seq 2 was never written anywhere
            sh.forward(1, [Span.attend(2, 6, 1)], randn(rng, 1, hq, 64))
        assert e.value.shard_errors.keys() == {0, 1}

        # Room on shard 1 again: the retry succeeds, as the call does on the reference.
        sh.shards[1].release([999])
        both(ref, sh, 1, *failing)
        both(ref, sh, 1, [Span.decode(1, 13), Span.decode(2, 6)], *qkv(rng, 2, 2, hq, hkv))
        both(ref, sh, 0, [Span.decode(1, 12)], *qkv(rng, 1, 1, hq, hkv))
        want = pages_and_sequences(ref.stats())
        assert [pages_and_sequences(s) for s in sh.stats()] == [want, want]


def test_killed_shard_fails_the_forward_and_the_rest_roll_back(client, start_servers):
    servers = start_servers(3)
    targets = [s.target for s in servers]
    hq, hkv = 6, 3
    config = CacheConfig(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=16)
    rng = np.random.default_rng(11)
    with pagedattn.ShardedClient(targets, timeout=30) as sc, client.create_cache(config) as ref:
        sh = sc.create_cache(config)
        both(ref, sh, 0, [Span.prefill(1, 8), Span.prefill(2, 3)], *qkv(rng, 11, 11, hq, hkv))
        survivors = [0, 2]
        before = {i: pages_and_sequences(sh.shards[i].stats()) for i in survivors}
        assert before == {0: (3, 13, 2), 2: (3, 13, 2)}

        servers[1].proc.kill()  # SIGKILL: no goodbye to the clients
        servers[1].proc.wait()
        # seq 1 decodes into a new page, seq 3 is new: both land on the survivors
        with pytest.raises(errors.Unavailable) as e:
            sh.forward(0, [Span.decode(1, 8), Span.prefill(3, 2)], *qkv(rng, 3, 3, hq, hkv))
        err = e.value
        assert (err.shard, err.target) == (1, targets[1])
        assert f"shard 1 ({targets[1]}) of 3 failed in Forward" in err.message
        assert err.rolled_back == [0, 2]  # the survivors were rolled back
        assert list(err.rollback_errors) == [1]  # the dead one could not be
        assert f"could NOT roll back shard 1 ({targets[1]})" in err.message

        # The survivors are as before: pages, sequences and what they answer.
        assert {i: pages_and_sequences(sh.shards[i].stats()) for i in survivors} == before
        q = randn(rng, 3, hq, 64)
        spans = [Span.attend(1, 8, 2), Span.attend(2, 3, 1)]
        want, want_lse = ref.forward(0, spans, q, return_lse=True)
        for i in survivors:
            heads = sh.q_heads(i)
            got, got_lse = sh.shards[i].forward(0, spans, q[:, heads.start:heads.stop],
                                                return_lse=True)
            same_bits(got, want[:, heads.start:heads.stop])
            same_bits(got_lse, want_lse[:, heads.start:heads.stop])

        # delete: the survivors' caches go, the dead shard's error names it
        with pytest.raises(errors.Unavailable) as e:
            sh.delete()
        assert e.value.shard == 1
        assert [s.deleted for s in sh.shards] == [True, False, True]
        for i in survivors:
            assert sh.cache_ids[i] not in [c.cache_id for c in sc.clients[i].list_caches()]


# -- targets ---------------------------------------------------------------------------------


def test_a_block_that_raises_keeps_its_exception_and_names_the_caches_left(client, start_servers):
    """Leaving `with sharded cache` by an exception while a shard is down: the block's exception
    goes on, noting which shard caches could not be deleted (a warning before Python 3.11)."""
    servers = start_servers(2)
    config = CacheConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=8)
    with pagedattn.ShardedClient([s.target for s in servers], timeout=5) as sc:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="the block failed") as e:
                with sc.create_cache(config) as cache:
                    left = cache.shards[1].cache_id
                    servers[1].proc.kill()
                    servers[1].proc.wait()
                    raise RuntimeError("the block failed")
        notes = getattr(e.value, "__notes__", None) or [str(w.message) for w in caught]
        assert len(notes) == 1, notes
        assert "deleting the sharded cache" in notes[0] and "shard 1" in notes[0]
        assert f"{left} on {servers[1].target}" in notes[0]
        assert cache.shards[0].deleted and not cache.shards[1].deleted


def test_the_same_target_twice_is_refused(shard_targets, monkeypatch):
    """Refused before any shard's client (and channel) is made: an aio client's channel could
    not be closed there (its close() is a coroutine, left un-awaited)."""
    made = []
    for client_type in (pagedattn.Client, pagedattn.aio.Client):
        def counted(self, *a, _init=client_type.__init__, **kw):
            made.append(a)
            _init(self, *a, **kw)

        monkeypatch.setattr(client_type, "__init__", counted)
    for sharded in (pagedattn.ShardedClient, pagedattn.aio.ShardedClient):
        with pytest.raises(ValueError, match=r"shard targets 0 and 2 are the same \("):
            sharded([shard_targets[0], shard_targets[1], shard_targets[0]])
        with pytest.raises(ValueError, match=r"target 'localhost:70000': the port is out of range"):
            sharded([shard_targets[0], "localhost:70000"])
    assert made == []


def test_targets_from_dns_are_sorted_and_unique(monkeypatch):
    def fake_getaddrinfo(host, port, *args, **kwargs):
        assert (host, port) == ("pagedattn.example", 50051)
        records = [(socket.AF_INET, "10.0.0.10"), (socket.AF_INET6, "fd00::2"),
                   (socket.AF_INET, "10.0.0.9"), (socket.AF_INET, "10.0.0.10"),
                   (socket.AF_INET6, "fd00::1")]
        return [(fam, socket.SOCK_STREAM, 6, "", (a, port) if fam == socket.AF_INET
                 else (a, port, 0, 0)) for fam, a in records]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    want = ["10.0.0.9:50051", "10.0.0.10:50051", "[fd00::1]:50051", "[fd00::2]:50051"]
    assert pagedattn.targets_from_dns("pagedattn.example", 50051) == want
    assert pagedattn.targets_from_dns("pagedattn.example:50051") == want
    with pytest.raises(ValueError):
        pagedattn.targets_from_dns("pagedattn.example")
    sc = pagedattn.ShardedClient("pagedattn.example:50051")
    assert sc.targets == want and sc.num_shards == 4
    sc.close()


def test_one_dns_name_is_its_addresses(shard_targets, monkeypatch):
    host, port = shard_targets[0].rsplit(":", 1)
    monkeypatch.setattr(socket, "getaddrinfo", lambda h, p, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (host, int(p)))])
    config = CacheConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=4)
    with pagedattn.ShardedClient(f"shards.example:{port}") as sc, sc.create_cache(config) as sh:
        assert sc.targets == [shard_targets[0]]
        assert sh.shards[0].config.num_q_heads == 2


# -- asyncio ---------------------------------------------------------------------------------


def test_aio_sharded_cache(client, shard_targets):
    hq, hkv = 8, 4
    config = CacheConfig(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=4,
                         kv_dtype="bfloat16", num_pages=8)
    rng = np.random.default_rng(5)

    async def main(ref) -> None:
        async with pagedattn.aio.ShardedClient(shard_targets[:2]) as sc:
            with pytest.raises(errors.CacheConfigError):
                await sc.create_cache(CacheConfig(1, 6, 3, 64, 4, "bfloat16", num_pages=8))
            async with await sc.create_cache(config, "aio") as sh:
                async def both_aio(spans, q, k=None, v=None, **kw):
                    want = ref.forward(0, spans, q, k, v, **kw)
                    same_bits(want, await sh.forward(0, spans, q, k, v, **kw))

                await both_aio([Span.prefill(1, 12)], *qkv(rng, 12, 12, hq, hkv))
                await both_aio([Span.decode(1, 12)], *qkv(rng, 1, 1, hq, hkv), return_lse=True)
                # fill shard 1: a decode that needs a page fails there, shard 0 is rolled back
                await sh.shards[1].forward(0, [Span.prefill(9, 16)], *qkv(rng, 16, 16, 4, 2))
                before = [pages_and_sequences(s) for s in await sh.stats()]
                with pytest.raises(errors.OutOfPages) as e:
                    await sh.forward(0, [Span.prefill(2, 4)], *qkv(rng, 4, 4, hq, hkv))
                assert e.value.shard == 1 and e.value.rolled_back == [0, 1]
                assert [pages_and_sequences(s) for s in await sh.stats()] == before
                await sh.shards[1].release([9])
                await both_aio([Span.prefill(2, 4)], *qkv(rng, 4, 4, hq, hkv))
                assert [r.released for r in await sh.release([1, 2])] == [2, 2]
                ids = sh.cache_ids
            assert sh.deleted
            for c, cache_id in zip(sc.clients, ids):
                with pytest.raises(errors.NotFound):
                    await c.get_cache(cache_id)

    with client.create_cache(config) as ref:
        asyncio.run(main(ref))
