"""pagedattn.aio.Client: the same API under asyncio, many Forwards in flight at once, and
errors with the same structure as the blocking client's."""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest

import pagedattn
import pagedattn.aio
from pagedattn import CacheConfig, Span, errors
from pagedattn.reference import reference_attention, relative_error
from pagedattn.smoke import round_to
from pagedattn.tensors import dtype_enum

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def test_math_inf_is_no_deadline(target, kv_dtypes):
    """As the blocking client: math.inf (it failed every call at once, DEADLINE_EXCEEDED)."""
    async def main() -> None:
        async with pagedattn.aio.Client(target, timeout=math.inf) as client:
            assert await client.health(timeout=math.inf)
            config = CacheConfig(1, 4, 2, 64, page_size=4, kv_dtype=kv_dtypes[0], num_pages=8)
            async with await client.create_cache(config) as cache:
                rng = np.random.default_rng(0)
                q, k, v = (rng.standard_normal((3, h, 64), dtype=np.float32) for h in (4, 2, 2))
                async with client.step(cache, [Span.prefill(1, 3)]) as step:
                    assert (await step.forward(0, q, k, v)).shape == (3, 4, 64)
            assert await client.health(timeout=1e12)

    asyncio.run(main())


def test_a_step_closed_after_its_client_was_raises_cancelled_as_the_blocking_one(target):
    """A Step whose layers were answered, closed (the end of its block) after another task closed
    its client: PagedAttnError CANCELLED, as the blocking client's, not a CancelledError in a task
    nobody cancelled (which a TaskGroup drops without a word)."""
    async def main() -> object:
        client = pagedattn.aio.Client(target)
        config = CacheConfig(1, 4, 2, 64, page_size=16, kv_dtype="float32", num_pages=8)
        async with pagedattn.aio.Client(target) as owner:
            cache = await owner.create_cache(config, "aio-closed-step")
            q, k, v = (np.ones((3, h, 64), np.float32) for h in (4, 2, 2))
            answered = asyncio.Event()

            async def worker() -> object:
                try:
                    async with client.step(cache.cache_id, [Span.prefill(1, 3)]) as step:
                        await step.forward(0, q, k, v)
                        answered.set()
                        await asyncio.sleep(0.2)  # its client closes meanwhile
                except errors.PagedAttnError as e:
                    return e
                return None

            task = asyncio.create_task(worker())
            await asyncio.wait_for(answered.wait(), 30)
            await client.close()
            result = await asyncio.gather(task, return_exceptions=True)
            await cache.delete()
            return result[0]

    result = asyncio.run(main())
    assert isinstance(result, errors.PagedAttnError), repr(result)
    assert result.code == grpc.StatusCode.CANCELLED, repr(result)


def test_every_method(target, kv_dtypes):
    async def main() -> None:
        async with pagedattn.aio.Client(target) as client:
            assert await client.health()
            info = await client.server_info()
            assert list(info.capabilities.head_dims) == [64, 80, 96, 128, 192, 256, 512]
            bad = CacheConfig(2, 32, 5, 100, page_size=0, kv_dtype="dtype_unspecified", num_pages=8)
            assert not (await client.validate(bad)).valid
            with pytest.raises(errors.CacheConfigError) as e:
                await client.create_cache(bad)
            assert sorted(e.value.fields) == ["head_dim", "kv_dtype", "num_q_heads", "page_size"]
            config = CacheConfig(1, 4, 2, 64, page_size=4, kv_dtype=kv_dtypes[0], num_pages=8)
            async with await client.create_cache(config, "aio") as cache:
                assert cache.cache_id in [c.cache_id for c in await client.list_caches()]
                rng = np.random.default_rng(0)
                q, k, v = (rng.standard_normal((5, h, 64), dtype=np.float32) for h in (4, 2, 2))
                out, lse = await cache.forward(0, [Span.prefill(1, 5)], q, k, v, return_lse=True)
                stored = lambda x: round_to(dtype_enum(kv_dtypes[0]), x)  # noqa: E731
                ref, ref_lse = reference_attention(q, stored(k), stored(v))
                assert relative_error(out, ref) <= TOLERANCE[kv_dtypes[0]]
                assert lse.shape == (5, 4)
                with pytest.raises(errors.FailedPrecondition):
                    await cache.forward(0, [Span.decode(1, 9)], q[:1], k[:1], v[:1])
                with pytest.raises(errors.OutOfPages) as e:
                    await cache.forward(0, [Span.prefill(2, 32)], *(
                        rng.standard_normal((32, h, 64), dtype=np.float32) for h in (4, 2, 2)))
                assert (e.value.pages_needed, e.value.free_pages) == (8, 6)
                assert (await cache.release([1])).freed_pages == 2
                assert (await cache.stats()).used_pages == 0
            assert cache.deleted
            with pytest.raises(errors.NotFound) as e:
                await client.get_cache(cache.cache_id)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            async with await client.create_cache(config) as gone:  # gone before the end
                await client.delete_cache(gone.cache_id)
            assert gone.deleted

    asyncio.run(main())


def test_a_step_cancelled_while_its_close_reads_is_cancelled(target, backend):
    """A timeout that fires while `async with step:` reads the answers at its end cancels the
    stream, as one that fires in the block does: the answers never read fail CANCELLED, and
    the server runs no more of its layers (it went on and committed every one)."""
    if backend != "cpu":
        pytest.skip("needs prefills that take longer than the timeout (the CPU backend's)")
    layers, n = 8, 1024

    async def main() -> None:
        async with pagedattn.aio.Client(target) as client:
            config = CacheConfig(layers, 16, 4, 128, page_size=16, kv_dtype="float32",
                                 num_pages=2 * n // 16)
            async with await client.create_cache(config) as cache:
                rng = np.random.default_rng(0)
                q, k, v = (rng.standard_normal((n, h, 128), dtype=np.float32) for h in (16, 4, 4))
                step = cache.step([Span.prefill(1, n)])
                futures = []

                async def send_all() -> None:  # the answers left for `async with` to read
                    async with step:
                        for layer in range(layers):
                            futures.append(await step.submit(layer, q, k, v))

                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(send_all(), 0.2)
                with pytest.raises(errors.PagedAttnError) as e:
                    await futures[-1]
                assert e.value.code == grpc.StatusCode.CANCELLED, e.value

    asyncio.run(main())


def test_many_forwards_in_flight(target, kv_dtypes):
    """32 sequences, each prefilled then decoded 4 steps; every step's Forwards run at once."""
    cache_dtype = kv_dtypes[0]
    stored = lambda x: round_to(dtype_enum(cache_dtype), x)  # noqa: E731
    n_seq, steps = 32, 4

    async def main() -> float:
        rng = np.random.default_rng(7)
        config = CacheConfig(1, 8, 2, 64, page_size=8, kv_dtype=cache_dtype, num_pages=n_seq * 2)
        async with pagedattn.aio.Client(target) as client:
            async with await client.create_cache(config) as cache:
                k = {s: rng.standard_normal((5 + s % 7, 2, 64), dtype=np.float32) for s in range(n_seq)}
                v = {s: rng.standard_normal(k[s].shape, dtype=np.float32) for s in range(n_seq)}
                q = {s: rng.standard_normal((k[s].shape[0], 8, 64), dtype=np.float32) for s in range(n_seq)}
                outs = await asyncio.gather(*(
                    cache.forward(0, [Span.prefill(s, len(k[s]))], q[s], k[s], v[s]) for s in range(n_seq)))
                worst = max(relative_error(o, reference_attention(q[s], stored(k[s]), stored(v[s]))[0])
                            for s, o in enumerate(outs))
                for _ in range(steps):
                    new = {s: [rng.standard_normal((1, h, 64), dtype=np.float32) for h in (8, 2, 2)]
                           for s in range(n_seq)}
                    outs = await asyncio.gather(*(
                        cache.forward(0, [Span.decode(s, len(k[s]))], *new[s]) for s in range(n_seq)))
                    for s, o in enumerate(outs):
                        k[s] = np.concatenate([k[s], new[s][1]])
                        v[s] = np.concatenate([v[s], new[s][2]])
                        ref = reference_attention(new[s][0], stored(k[s]), stored(v[s]))[0]
                        worst = max(worst, relative_error(o, ref))
                stats = await cache.stats()
                assert stats.forward_calls == n_seq * (steps + 1)
                assert stats.live_sequences == n_seq
                return worst

    assert asyncio.run(main()) <= TOLERANCE[cache_dtype]


def test_closing_the_client_fails_its_calls_in_flight_as_the_blocking_client(target, backend):
    """close() while a Forward and a Step layer run: each raises PagedAttnError CANCELLED (as the
    blocking client's do), never CancelledError in a task nobody cancelled; a cancelled task's
    own CancelledError stays one."""
    if backend != "cpu":
        pytest.skip("needs Forwards long enough to be in flight at close() (the CPU backend's "
                    "float32 prefill of 2048 tokens; a GPU's takes a millisecond)")
    async def main() -> None:
        client = pagedattn.aio.Client(target)
        config = CacheConfig(1, 4, 2, 64, page_size=16, kv_dtype="float32", num_pages=256)
        cache = await client.create_cache(config, "aio-close")
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((2048, h, 64), dtype=np.float32) for h in (4, 2, 2))

        async def unary() -> object:
            try:
                return await cache.forward(0, [Span.prefill(1, 2048)], q, k, v)
            except errors.PagedAttnError as e:
                return e

        async def layer() -> object:
            try:
                async with cache.step([Span.prefill(2, 2048)]) as step:
                    return await step.forward(0, q, k, v)
            except errors.PagedAttnError as e:
                return e

        tasks = [asyncio.create_task(unary()), asyncio.create_task(layer())]
        await asyncio.sleep(0.05)  # both calls in flight on the server
        await client.close()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            assert isinstance(result, errors.PagedAttnError), repr(result)
            assert result.code == grpc.StatusCode.CANCELLED or isinstance(
                result, errors.ClientClosed), repr(result)
        with pytest.raises(errors.ClientClosed):
            await cache.forward(0, [Span.prefill(3, 1)], q[:1], k[:1], v[:1])
        assert cache.step([Span.prefill(3, 1)]).closed  # a closed client's Step says so
        async with pagedattn.aio.Client(target) as other:  # the cache is still there: delete it
            await other.delete_cache(cache.cache_id)

    asyncio.run(main())
