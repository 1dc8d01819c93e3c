"""The Step stream (Client.step / aio.Client.step) against a real server: every layer of a step
on one stream, answers equal to unary Forwards of the same inputs, layers pipelined (all sent
before the first answer is read), per-layer errors raised as forward() raises them while the
stream goes on, closing and cancelling mid-step, the asyncio twin, and the messages on the wire
(spans with the first layer only)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

import pagedattn
import pagedattn.aio
from pagedattn import CacheConfig, Span, errors
from pagedattn._common import StepMessages, forward_request
from pagedattn.reference import reference_attention, relative_error
from pagedattn.smoke import round_to
from pagedattn.tensors import dtype_enum

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
HQ, HKV, D = 4, 2, 64


def config(kv_dtype: str, num_layers: int = 4, num_pages: int = 32) -> CacheConfig:
    return CacheConfig(num_layers, HQ, HKV, D, page_size=4, kv_dtype=kv_dtype, num_pages=num_pages)


def qkv(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(rng.standard_normal((n, h, D), dtype=np.float32) for h in (HQ, HKV, HKV))


def assert_same(a, b) -> None:
    """The step's answer is the unary Forward's, bit for bit (same server, same inputs)."""
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# -- the messages --------------------------------------------------------------------------


def test_spans_go_with_the_first_message_of_each_step_only():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 3)
    m = StepMessages()
    m.begin("c" * 32, [Span.prefill(1, 3)], False, 0.5, True, None)
    first = m.request(0, q, k, v)
    m.sent()
    assert first.cache_id == "c" * 32 and first.layer == 0
    assert [(s.seq_id, s.num_new_tokens) for s in first.spans] == [(1, 3)]
    assert first.options.causal is False and first.options.sm_scale == 0.5
    assert first.options.return_lse and list(first.q.shape) == [3, HQ, D]
    second = m.request(1, q, k, v)
    m.sent()
    assert second.layer == 1 and not second.cache_id and not second.spans
    assert not second.HasField("options") and list(second.k.shape) == [3, HKV, D]
    assert m.return_lse
    # The next step on the same stream: spans and options again, the stream's cache kept.
    m.begin(None, [Span.decode(1, 3)], None, None, False, None)
    third = m.request(0, q[:1], None, None)
    m.sent()
    assert not third.cache_id and [s.start for s in third.spans] == [3]
    assert not third.options.HasField("causal") and not third.options.return_lse
    assert not third.HasField("k")
    assert not m.request(1, q[:1], None, None).spans
    with pytest.raises(ValueError, match="at least one span"):
        m.begin(None, [], None, None, False, None)
    # begin() before the stream's first message: that message still names the cache.
    m = StepMessages()
    m.begin("c" * 32, [Span.prefill(1, 3)], None, None, False, None)
    m.begin(None, [Span.prefill(2, 3)], True, None, False, None)
    first = m.request(0, q, k, v)
    assert first.cache_id == "c" * 32 and [s.seq_id for s in first.spans] == [2]
    assert first.options.causal
    with pytest.raises(ValueError, match="k and v together"):
        m.request(0, q, k, None)


# -- results -------------------------------------------------------------------------------


def test_step_answers_equal_unary_forwards(client, kv_dtypes):
    """Two caches fed the same data, one through Step streams and one through unary Forwards:
    a prefill of two sequences (every layer), then decode steps, with lse and options."""
    rng = np.random.default_rng(1)
    cache_dtype = kv_dtypes[0]
    layers = 4
    with client.create_cache(config(cache_dtype)) as streamed, \
            client.create_cache(config(cache_dtype)) as unary:
        spans = [Span.prefill(1, 7), Span.prefill(2, 3)]
        data = [qkv(rng, 10) for _ in range(layers)]
        with streamed.step(spans, return_lse=True, causal=True, sm_scale=0.2) as step:
            got = [step.forward(layer, *data[layer]) for layer in range(layers)]
        want = [unary.forward(layer, spans, *data[layer], return_lse=True, causal=True,
                              sm_scale=0.2) for layer in range(layers)]
        for g, w in zip(got, want):
            assert_same(g, w)
        # And the answer is right, not only equal: layer 0, sequence 1, against float64.
        q, k, v = data[0]
        stored = lambda x: round_to(dtype_enum(cache_dtype), x)  # noqa: E731
        ref, _ = reference_attention(q[:7], stored(k[:7]), stored(v[:7]), sm_scale=0.2)
        assert relative_error(got[0][0][:7], ref) <= TOLERANCE[cache_dtype]

        # Decode steps: one stream per step, then several steps on one stream (begin()).
        lengths = [7, 3]
        with streamed.step([Span.decode(1, 7), Span.decode(2, 3)]) as step:
            data = [qkv(rng, 2) for _ in range(layers)]
            got = [step.forward(layer, *data[layer]) for layer in range(layers)]
        for layer in range(layers):
            want = unary.forward(layer, [Span.decode(1, 7), Span.decode(2, 3)], *data[layer])
            assert_same(got[layer], want)
        lengths = [8, 4]
        with client.step(streamed.cache_id, [Span.decode(1, 8), Span.decode(2, 4)]) as step:
            for n in range(3):
                if n:
                    step.begin([Span.decode(1, lengths[0]), Span.decode(2, lengths[1])])
                data = [qkv(rng, 2) for _ in range(layers)]
                got = [step.forward(layer, *data[layer]) for layer in range(layers)]
                spans = [Span.decode(1, lengths[0]), Span.decode(2, lengths[1])]
                for layer in range(layers):
                    assert_same(got[layer], unary.forward(layer, spans, *data[layer]))
                lengths = [n + 1 for n in lengths]
        a, b = streamed.stats(), unary.stats()
        assert (a.used_pages, a.live_sequences) == (b.used_pages, b.live_sequences) == (5, 2)
        assert a.forward_calls == b.forward_calls == 5 * layers


def test_torch_tensors_and_wire_dtype(client, kv_dtypes):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(5, h, D, generator=gen) for h in (HQ, HKV, HKV))
    with client.create_cache(config(kv_dtypes[0], num_layers=2)) as a, \
            client.create_cache(config(kv_dtypes[0], num_layers=2)) as b:
        with a.step([Span.prefill(1, 5)], dtype="bfloat16") as step:
            got = [step.forward(layer, q, k, v) for layer in range(2)]
        for layer in range(2):
            want = b.forward(layer, [Span.prefill(1, 5)], q, k, v, dtype="bfloat16")
            assert isinstance(got[layer], torch.Tensor) and got[layer].dtype == torch.bfloat16
            assert torch.equal(got[layer], want)


def test_pipelined_layers_answer_in_order(client, kv_dtypes):
    """Every layer sent before the first answer is read; answers in the order sent."""
    rng = np.random.default_rng(3)
    layers = 8
    with client.create_cache(config(kv_dtypes[0], num_layers=layers)) as streamed, \
            client.create_cache(config(kv_dtypes[0], num_layers=layers)) as unary:
        spans = [Span.prefill(1, 9), Span.prefill(2, 4), Span.prefill(3, 1)]
        data = [qkv(rng, 14) for _ in range(layers)]
        with streamed.step(spans) as step:
            futures = [step.submit(layer, *data[layer]) for layer in range(layers)]
            assert [f.layer for f in futures] == list(range(layers))
            assert all(f.timing is None for f in futures if not f.done())
            # Read the last first: it reads (and keeps) every answer before it.
            last = futures[-1].result()
            assert all(f.done() for f in futures)
            got = [f.result() for f in futures]
            assert got[-1] is last
            for f in futures:
                assert f.timing.server_micros > 0 and f.timing.kernel_micros >= 0
            assert step.last_timing == futures[-1].timing
        for layer in range(layers):
            assert_same(got[layer], unary.forward(layer, spans, *data[layer]))
        assert streamed.stats().forward_calls == layers


# -- errors --------------------------------------------------------------------------------


def _unary_error(cache, *args, **kwargs) -> errors.PagedAttnError:
    with pytest.raises(errors.PagedAttnError) as e:
        cache.forward(*args, **kwargs)
    return e.value


def test_a_layers_error_is_forwards_and_the_stream_goes_on(client, kv_dtypes):
    rng = np.random.default_rng(4)
    with client.create_cache(config(kv_dtypes[0], num_layers=2, num_pages=3)) as cache:  # 12 tokens
        q, k, v = qkv(rng, 5)
        with cache.step([Span.prefill(1, 5)]) as step:
            out0 = step.submit(0, q, k, v)
            beyond = step.submit(7, q, k, v)  # layer out of range
            heads = step.submit(1, q[:, :3], k, v)  # 3 q heads, the cache has 4
            out1 = step.submit(1, q, k, v)  # fine: the stream went on
            with pytest.raises(errors.InvalidArgument) as e:
                beyond.result()
            want = _unary_error(cache, 7, [Span.prefill(9, 5)], q, k, v)
            assert type(e.value) is type(want) and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.message == want.message and "layer" in e.value.message
            assert e.value.status is not None and e.value.status.code == 3
            with pytest.raises(errors.InvalidArgument) as e:
                heads.result()
            assert not isinstance(e.value, errors.CacheConfigError)
            with pytest.raises(errors.InvalidArgument):  # raised again, the same
                heads.result()
            assert out0.result().shape == out1.result().shape == (5, HQ, D)
            # OUT_OF_PAGES, with the numbers of its google.rpc.ErrorInfo, as forward() has them.
            step.begin([Span.prefill(2, 9)])  # 3 more pages, 1 free
            q9, k9, v9 = qkv(rng, 9)
            with pytest.raises(errors.OutOfPages) as e:
                step.forward(0, q9, k9, v9)
            err = e.value
            assert (err.pages_needed, err.free_pages, err.total_pages) == (3, 1, 3)
            assert err.page_size == 4
            assert err.reason == "OUT_OF_PAGES"
            want = _unary_error(cache, 0, [Span.prefill(2, 9)], q9, k9, v9)
            assert type(want) is errors.OutOfPages and want.message == err.message
            # A gap: FailedPrecondition; then a good decode step on the same stream.
            step.begin([Span.decode(1, 6)])
            with pytest.raises(errors.FailedPrecondition):
                step.forward(0, *qkv(rng, 1))
            step.begin([Span.decode(1, 5)])
            assert step.forward(0, *qkv(rng, 1)).shape == (1, HQ, D)
        stats = cache.stats()
        assert (stats.used_pages, stats.live_sequences) == (2, 1)  # the failures left nothing


def _raw_step(client, messages: list[bytes]) -> list[int]:
    """The status code answering each raw Step message, sent in order on one stream."""
    step = client.channel.stream_stream(
        "/pagedattn.v1.AttentionService/Step", request_serializer=lambda b: b,
        response_deserializer=pagedattn.pb.StepResponse.FromString)
    return [r.error.code for r in step(iter(messages), timeout=60)]


def _message(cache, layer, spans, q, k, v, opens: bool = True) -> pagedattn.pb.ForwardRequest:
    req = forward_request(cache, layer, spans, q, k, v, None, None, False, None)
    if not opens:  # a layer of the open step: no spans, no cache_id
        req.ClearField("spans")
        req.ClearField("cache_id")
    return req


OK, INVALID_ARGUMENT = 0, grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_garbled_message_ends_the_open_step(client, kv_dtypes):
    """Bytes that do not parse may have been the next step's opening message: the layers after
    them must not run with the old step's spans (they would write over its positions)."""
    rng = np.random.default_rng(12)
    with client.create_cache(config(kv_dtypes[0], num_layers=2)) as cache:
        t0, t1 = qkv(rng, 1), qkv(rng, 1)
        step0 = [_message(cache, 0, [Span.prefill(1, 1)], *t0),
                 _message(cache, 1, [Span.prefill(1, 1)], *t0, opens=False)]
        garbled = _message(cache, 0, [Span.decode(1, 1)], *t1).SerializeToString() + b"\xff"
        after = _message(cache, 1, [Span.decode(1, 1)], *t1, opens=False)
        reopened = _message(cache, 0, [Span.decode(1, 1)], *t1)
        codes = _raw_step(client, [m.SerializeToString() for m in step0] +
                          [garbled, after.SerializeToString(), reopened.SerializeToString()])
        assert codes == [OK, OK, INVALID_ARGUMENT, INVALID_ARGUMENT, OK]
        # Layer 1 holds position 0 alone: its decode at position 1 is no gap, at 2 it is one.
        with pytest.raises(errors.FailedPrecondition):
            cache.forward(1, [Span.decode(1, 2)], *qkv(rng, 1))
        assert cache.forward(1, [Span.decode(1, 1)], *t1).shape == (1, HQ, D)


def test_begin_reopens_a_step_the_server_ended(start_servers, kv_dtypes):
    """A step of more spans than the server's --max_forward_spans ends the open step and the
    stream's cache (the parse refuses it); begin() without cache= opens the next step on the
    stream's cache all the same (it sent no cache_id, and every layer after was refused). A q of
    more than 8 dimensions is refused before sending, the stream going on."""
    (server,) = start_servers(1, "--max_forward_spans=2")
    rng = np.random.default_rng(13)
    with pagedattn.Client(server.target) as c, c.create_cache(config(kv_dtypes[0])) as cache:
        with c.step(cache, [Span.prefill(1, 1)]) as step:
            assert step.forward(0, *qkv(rng, 1)).shape == (1, HQ, D)
            with pytest.raises(ValueError, match=r"^q has 9 dimensions; a tensor has at most 8"):
                step.forward(1, np.zeros((1,) * 8 + (D,), np.float32))
            step.begin([Span.prefill(s, 1) for s in (2, 3, 4)])
            with pytest.raises(errors.PagedAttnError, match="max_forward_spans"):
                step.forward(0, *qkv(rng, 3))
            step.begin([Span.decode(1, 1)])
            assert step.forward(0, *qkv(rng, 1)).shape == (1, HQ, D)
        assert cache.stats().used_pages > 0


def test_a_step_that_ended_leaves_no_thread_behind(target, kv_dtypes):
    """Steps left open (still referenced) when their client closes: grpc's thread that sends a
    stream's messages ends with the stream (each stayed blocked until its Step was collected)."""
    rng = np.random.default_rng(14)
    before = threading.active_count()
    with pagedattn.Client(target) as owner, owner.create_cache(config(kv_dtypes[0])) as cache:
        c = pagedattn.Client(target)
        steps = []
        for i in range(5):
            steps.append(c.step(cache, [Span.prefill(10 + i, 1)]))
            steps[-1].forward(0, *qkv(rng, 1))
        assert threading.active_count() >= before + 5  # a sending thread each
        c.close()
        for _ in range(200):
            if threading.active_count() <= before:
                break
            time.sleep(0.05)
        assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


def test_a_layer_message_naming_another_cache_or_options_is_refused(client, kv_dtypes):
    rng = np.random.default_rng(13)
    with client.create_cache(config(kv_dtypes[0], num_layers=3)) as cache:
        t = qkv(rng, 2)
        opener = _message(cache, 0, [Span.prefill(1, 2)], *t)
        same = _message(cache, 1, [Span.prefill(1, 2)], *t, opens=False)
        same.cache_id = cache.cache_id  # the step's own cache: harmless
        other = _message(cache, 2, [Span.prefill(1, 2)], *t, opens=False)
        other.cache_id = "0" * 32
        scaled = _message(cache, 2, [Span.prefill(1, 2)], *t, opens=False)
        scaled.options.sm_scale = 0.5
        codes = _raw_step(client, [m.SerializeToString() for m in (opener, same, other, scaled)])
        assert codes == [OK, OK, INVALID_ARGUMENT, INVALID_ARGUMENT]
        # What the options mean counts, not how they were sent: causal set to its default on a
        # layer of a step that left it unset is the same step; so is the step's scale repeated.
        t2 = qkv(rng, 2)
        opener = _message(cache, 0, [Span.prefill(2, 2)], *t2)
        opener.options.sm_scale = 0.25
        causal = _message(cache, 1, [Span.prefill(2, 2)], *t2, opens=False)
        causal.options.causal = True
        causal.options.sm_scale = 0.25
        anti = _message(cache, 2, [Span.prefill(2, 2)], *t2, opens=False)
        anti.options.causal = False
        codes = _raw_step(client, [m.SerializeToString() for m in (opener, causal, anti)])
        assert codes == [OK, OK, INVALID_ARGUMENT]

    # A step that set no scale has its cache's, 1/sqrt(head_dim) rounded to float32 once: a layer
    # that spells it out as a client would (head_dim ** -0.5) is the same step, another scale is
    # not. Head dim 96, where float32's 1 / sqrtf(96) is 1 ulp off.
    wide = CacheConfig(3, HQ, HKV, 96, page_size=4, kv_dtype=kv_dtypes[0], num_pages=32)
    with client.create_cache(wide) as cache:
        t3 = tuple(rng.standard_normal((2, h, 96), dtype=np.float32) for h in (HQ, HKV, HKV))
        opener = _message(cache, 0, [Span.prefill(3, 2)], *t3)
        spelled = _message(cache, 1, [Span.prefill(3, 2)], *t3, opens=False)
        spelled.options.sm_scale = 96 ** -0.5
        other_scale = _message(cache, 2, [Span.prefill(3, 2)], *t3, opens=False)
        other_scale.options.sm_scale = 0.5
        codes = _raw_step(client, [m.SerializeToString() for m in (opener, spelled, other_scale)])
        assert codes == [OK, OK, INVALID_ARGUMENT]
        # The step's cache deleted under it: a layer spelling a scale out fails for the cache
        # (NOT_FOUND), as one without does, not as other options.
        opener = _message(cache, 0, [Span.prefill(4, 2)], *t3)

        def deleted_after_opener():
            yield opener.SerializeToString()
            time.sleep(0.2)
            cache.delete()
            yield spelled.SerializeToString()
        step = client.channel.stream_stream(
            "/pagedattn.v1.AttentionService/Step", request_serializer=lambda b: b,
            response_deserializer=pagedattn.pb.StepResponse.FromString)
        codes = [r.error.code for r in step(deleted_after_opener(), timeout=60)]
        assert codes[1] == grpc.StatusCode.NOT_FOUND.value[0], codes


def test_stream_failure_reaches_every_future_and_close():
    q, k, v = qkv(np.random.default_rng(5), 1)
    with pagedattn.Client("127.0.0.1:1", timeout=5) as c:
        step = c.step("0" * 32, [Span.prefill(1, 1)])
        first, second = step.submit(0, q, k, v), step.submit(1, q, k, v)
        with pytest.raises(errors.Unavailable):
            second.result()
        assert first.done()
        with pytest.raises(errors.Unavailable):
            first.result()
        step.close()  # the failure was raised already: not again
        with pytest.raises(errors.Unavailable):
            step.submit(0, q, k, v)
        # Not read by anyone: close() raises it.
        step = c.step("0" * 32, [Span.prefill(1, 1)])
        step.submit(0, q, k, v)
        with pytest.raises(errors.Unavailable):
            step.close()
    with pytest.raises(ValueError, match="at least one span"):
        pagedattn.Client("127.0.0.1:1").step("0" * 32, [])


# -- ending mid-step -----------------------------------------------------------------------


def test_close_mid_step_drains_the_answers(client, kv_dtypes):
    rng = np.random.default_rng(6)
    layers = 4
    with client.create_cache(config(kv_dtypes[0])) as streamed, \
            client.create_cache(config(kv_dtypes[0])) as unary:
        data = [qkv(rng, 6) for _ in range(layers)]
        step = streamed.step([Span.prefill(1, 6)])
        futures = [step.submit(layer, *data[layer]) for layer in range(layers)]
        step.close()  # nothing read yet: close() reads every answer and the stream's end
        assert step.closed and all(f.done() for f in futures)
        for layer, f in enumerate(futures):
            assert_same(f.result(), unary.forward(layer, [Span.prefill(1, 6)], *data[layer]))
        with pytest.raises(RuntimeError, match="closed"):
            step.submit(0, *data[0])
        with pytest.raises(RuntimeError, match="closed"):  # not accepted, to fail at submit
            step.begin([Span.decode(1, 6)])
        step.close()  # idempotent
        assert streamed.stats().forward_calls == layers


def test_a_closed_clients_step_sends_nothing_more(target, kv_dtypes):
    rng = np.random.default_rng(8)
    c = pagedattn.Client(target)
    cache = c.create_cache(config(kv_dtypes[0]), delete_on_exit=False)
    step = cache.step([Span.prefill(1, 6)])
    step.forward(0, *qkv(rng, 6))
    assert not step.closed
    c.close()
    assert step.closed  # as it says once close() ends its call
    with pytest.raises(errors.ClientClosed):
        step.submit(1, *qkv(rng, 6))
    step.cancel()

    async def closed_aio() -> None:  # the same (it gave a future that failed CANCELLED)
        c = pagedattn.aio.Client(target)
        step = c.step(cache.cache_id, [Span.prefill(1, 6)])
        await step.forward(0, *qkv(rng, 6))
        await c.close()
        assert step.closed
        with pytest.raises(errors.ClientClosed):
            await step.submit(1, *qkv(rng, 6))
        step.cancel()

    asyncio.run(closed_aio())
    with pagedattn.Client(target) as other:
        other.delete_cache(cache.cache_id)


def test_cancel_mid_step(client, kv_dtypes):
    rng = np.random.default_rng(7)
    layers = 4
    with client.create_cache(config(kv_dtypes[0])) as cache:
        step = cache.step([Span.prefill(1, 6)])
        done = step.forward(0, *qkv(rng, 6))
        futures = [step.submit(layer, *qkv(rng, 6)) for layer in range(1, layers)]
        step.cancel()
        assert step.closed
        for f in futures:
            with pytest.raises(errors.PagedAttnError) as e:
                f.result()
            assert e.value.code == grpc.StatusCode.CANCELLED
        with pytest.raises(errors.PagedAttnError):
            step.submit(0, *qkv(rng, 6))
        step.close()  # after a cancel: nothing to raise
        assert done.shape == (6, HQ, D)
        # An exception in the with-block cancels the stream and propagates as it is.
        with pytest.raises(KeyError):
            with cache.step([Span.prefill(2, 2)]) as step2:
                step2.submit(0, *qkv(rng, 2))
                raise KeyError("boom")
        assert step2.closed
        # The cache serves new streams; layer 0 of sequence 1 was committed before the cancel.
        with cache.step([Span.decode(1, 6)]) as step3:
            assert step3.forward(0, *qkv(rng, 1)).shape == (1, HQ, D)
        with cache.step([Span.prefill(3, 2)]) as step4:
            assert [f.result().shape for f in [step4.submit(layer, *qkv(rng, 2))
                                               for layer in range(layers)]] == [(2, HQ, D)] * layers


# -- asyncio -------------------------------------------------------------------------------


def test_async_step(target, kv_dtypes):
    layers = 4

    async def main() -> None:
        rng = np.random.default_rng(8)
        async with pagedattn.aio.Client(target) as client:
            async with await client.create_cache(config(kv_dtypes[0])) as streamed, \
                    await client.create_cache(config(kv_dtypes[0])) as unary:
                spans = [Span.prefill(1, 5), Span.prefill(2, 2)]
                data = [qkv(rng, 7) for _ in range(layers)]
                async with streamed.step(spans, return_lse=True) as step:
                    first = await step.forward(0, *data[0])
                    futures = [await step.submit(layer, *data[layer]) for layer in range(1, layers)]
                    rest = [await f for f in futures]
                    assert all(f.timing.server_micros > 0 for f in futures)
                for layer, got in enumerate([first, *rest]):
                    want = await unary.forward(layer, spans, *data[layer], return_lse=True)
                    assert_same(got, want)

                # A layer's error raises forward()'s exception; the stream goes on.
                async with client.step(streamed, [Span.decode(1, 5)]) as step:
                    bad = await step.submit(9, *qkv(rng, 1))
                    good = await step.submit(1, *qkv(rng, 1))
                    with pytest.raises(errors.InvalidArgument, match="layer"):
                        await bad.result()
                    assert (await good).shape == (1, HQ, D)
                    step.begin([Span.decode(1, 7)])  # a gap
                    with pytest.raises(errors.FailedPrecondition):
                        await step.forward(0, *qkv(rng, 1))

                # Closing mid-step drains; cancelling fails what is not answered.
                step = streamed.step([Span.prefill(3, 3)])
                futures = [await step.submit(layer, *qkv(rng, 3)) for layer in range(layers)]
                await step.close()
                assert all(f.done() for f in futures)
                assert [(await f).shape for f in futures] == [(3, HQ, D)] * layers
                with pytest.raises(RuntimeError, match="closed"):
                    await step.submit(0, *qkv(rng, 3))
                step = streamed.step([Span.prefill(4, 3)])
                futures = [await step.submit(layer, *qkv(rng, 3)) for layer in range(layers)]
                step.cancel()
                for f in futures:
                    with pytest.raises(errors.PagedAttnError) as e:
                        await f
                    assert e.value.code == grpc.StatusCode.CANCELLED
                await step.close()
                assert (await streamed.stats()).live_sequences >= 3

        async with pagedattn.aio.Client("127.0.0.1:1", timeout=5) as client:
            step = client.step("0" * 32, [Span.prefill(1, 1)])
            f = await step.submit(0, *qkv(rng, 1))
            with pytest.raises(errors.Unavailable):
                await f
            await step.close()

    asyncio.run(main())


def test_async_every_layer_sent_before_reading_big_answers(target, kv_dtypes):
    """12 layers of 8 MiB each way, all submitted before the first answer is read: the server
    reads ahead only a few messages while its answers wait to be read, so the messages must go
    out from a writer of their own (a submit that waited for its write would hang here)."""
    layers, seqs, tokens, hq, d = 12, 256, 4, 8, 256

    async def main() -> None:
        rng = np.random.default_rng(9)
        cfg = CacheConfig(layers, hq, 2, d, page_size=4, kv_dtype=kv_dtypes[0], num_pages=seqs)
        q = rng.standard_normal((seqs * tokens, hq, d), dtype=np.float32)
        k = rng.standard_normal((seqs * tokens, 2, d), dtype=np.float32)
        async with pagedattn.aio.Client(target, timeout=60) as client:
            async with await client.create_cache(cfg) as cache:
                spans = [Span.prefill(s, tokens) for s in range(seqs)]
                async with cache.step(spans) as step:
                    futures = [await step.submit(layer, q, k, k) for layer in range(layers)]
                    outs = [await f for f in futures]
                assert all(o.shape == q.shape for o in outs)
                assert outs[0].nbytes == 8 << 20

    asyncio.run(main())


def test_async_a_submitted_layer_goes_out_before_the_next_is_made(target, kv_dtypes):
    """submit() lets the stream's writer take the message at once (it waited in the outbox until
    the caller's next wait, while the caller encoded every other layer)."""
    async def main() -> None:
        rng = np.random.default_rng(15)
        async with pagedattn.aio.Client(target) as c:
            async with await c.create_cache(config(kv_dtypes[0])) as cache:
                async with c.step(cache.cache_id, [Span.prefill(1, 1)]) as step:
                    first = await step.submit(0, *qkv(rng, 1))
                    assert step._outbox.qsize() == 0
                    assert (await first).shape == (1, HQ, D)

    asyncio.run(main())


def test_async_a_waiter_cancelled_leaves_the_stream_going(target, kv_dtypes):
    """asyncio.wait_for giving up on one layer's answer cancels that wait, not the stream: grpc.aio
    cancels the whole call when a read() is cancelled, so the read is shared and shielded. Every
    answer still comes, equal to the unary Forward's; close() ends the stream cleanly."""

    async def main() -> None:
        rng = np.random.default_rng(4)
        async with pagedattn.aio.Client(target, timeout=60) as client:
            async with await client.create_cache(config(kv_dtypes[0], 16, 512)) as cache:
                q, k, v = qkv(rng, 1000)
                step = cache.step([Span.prefill(1, 1000)])
                futures = [await step.submit(layer, q, k, v) for layer in range(16)]
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(futures[15].result(), 0.001)
                outs = [await f for f in futures]
                await step.close()
                assert not step._failure
                await cache.truncate(0, {1: 0})
                assert_same(outs[0], await cache.forward(0, [Span.prefill(1, 1000)], q, k, v))

    asyncio.run(main())


def test_async_a_dropped_step_ends_its_call(target, kv_dtypes):
    """A Step dropped without close() or cancel() cancels its call (as the blocking Step does):
    none is left open on the server, its grpc tasks pending, until the channel closes. Dropped
    with layers unanswered or not yet written too, and without asyncio's "Task was destroyed
    but it is pending!" (its writer was collected with it)."""
    import gc
    import logging

    class Errors(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    async def main() -> None:
        rng = np.random.default_rng(5)
        async with pagedattn.aio.Client(target, timeout=60) as client:
            async with await client.create_cache(config(kv_dtypes[0])) as cache:
                before = len(asyncio.all_tasks())
                for i in range(30):
                    step = cache.step([Span.prefill(100 + i, 2)])
                    future = await step.submit(0, *qkv(rng, 2))
                    if i % 3 == 0:
                        await future
                    elif i % 3 == 1:  # the second layer's message still in the outbox
                        await future
                        await step.submit(1, *qkv(rng, 2))
                    del step, future
                gc.collect()
                for _ in range(50):  # the cancellations' callbacks run on the loop
                    await asyncio.sleep(0.01)
                    if len(asyncio.all_tasks()) <= before:
                        break
                assert len(asyncio.all_tasks()) <= before

    errors = Errors()
    logging.getLogger("asyncio").addHandler(errors)
    try:
        asyncio.run(main())
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(errors)
    assert errors.messages == []


def test_async_a_server_gone_mid_stream_is_unavailable(start_servers, kv_dtypes):
    """A server killed under an open stream: the layers sent after it raise Unavailable naming
    the target, as the blocking Step does, not grpc.aio's INTERNAL for a write to an ended
    stream (which replaces the stream's status). Several rounds: which comes first is a race."""

    async def round_(rng: np.random.Generator) -> None:
        (server,) = start_servers(1)
        async with pagedattn.aio.Client(server.target, timeout=30) as client:
            cache = await client.create_cache(config(kv_dtypes[0]))
            for layer in range(4):
                await cache.forward(layer, [Span.prefill(1, 4)], *qkv(rng, 4))
            step = cache.step([Span.decode(1, 4)])
            await step.forward(0, *qkv(rng, 1))
            server.proc.kill()
            server.proc.wait(timeout=30)
            futures = [await step.submit(layer, *qkv(rng, 1)) for layer in range(1, 4)]
            with pytest.raises(errors.Unavailable, match=f"Step stream to {server.target}"):
                await futures[0]
            await step.close()  # raised already: not again

    rng = np.random.default_rng(11)
    for _ in range(4):
        asyncio.run(round_(rng))


def test_a_streams_end_names_its_server_and_deadline(start_servers, kv_dtypes):
    """The stream's own failures (not a layer's) say which server, and a deadline that the
    stream's timeout covers the whole stream: each layer was quick, the stream was not."""
    rng = np.random.default_rng(12)
    (server,) = start_servers(1)
    with pagedattn.Client(server.target, timeout=30) as client:
        # Not deleted at the end: its server is gone by then.
        with client.create_cache(config(kv_dtypes[0]), delete_on_exit=False) as cache:
            for layer in range(4):
                cache.forward(layer, [Span.prefill(1, 4)], *qkv(rng, 4))
            with cache.step([Span.decode(1, 4)], timeout=0.5) as step:
                step.forward(0, *qkv(rng, 1))
                time.sleep(0.6)
                with pytest.raises(errors.DeadlineExceeded,
                                   match=rf"Step stream to {server.target}: its deadline, 0\.5 s, "
                                   "covers the whole stream"):
                    step.forward(1, *qkv(rng, 1))

            async def late() -> None:
                async with pagedattn.aio.Client(server.target, timeout=30) as aio_client:
                    async with aio_client.step(cache.cache_id, [Span.decode(1, 4)],
                                               timeout=0.5) as step:
                        await step.forward(0, *qkv(rng, 1))
                        await asyncio.sleep(0.6)
                        with pytest.raises(errors.DeadlineExceeded, match=r"0\.5 s, covers the "
                                           "whole stream"):
                            await step.forward(1, *qkv(rng, 1))

            asyncio.run(late())
            step = cache.step([Span.decode(1, 4)])
            step.forward(0, *qkv(rng, 1))
            server.proc.kill()
            server.proc.wait(timeout=30)
            with pytest.raises(errors.Unavailable, match=f"Step stream to {server.target}"):
                step.forward(1, *qkv(rng, 1))


def test_a_killed_clients_stream_end_names_its_peer(start_servers, kv_dtypes):
    """Clients killed with Step streams open: each stream's end is logged with the client's
    address, not the "unknown" gRPC reports once the connection is gone, and two clients' ends
    are not merged into one throttled line."""
    import re
    import signal
    import subprocess
    import sys

    (server,) = start_servers(1)
    child = f"""
import sys, time, numpy as np, pagedattn
from pagedattn import CacheConfig, Span
c = pagedattn.Client({server.target!r}, timeout=30)
cache = c.create_cache(CacheConfig(1, 4, 2, 64, page_size=4, kv_dtype={kv_dtypes[0]!r},
                                   num_pages=8), delete_on_exit=False)
rng = np.random.default_rng(0)
x = lambda h: rng.standard_normal((4, h, 64), dtype=np.float32)
step = cache.step([Span.prefill(1, 4)])
step.forward(0, x(4), x(2), x(2))
print("ready", flush=True)
time.sleep(60)
"""
    kids = [subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        for kid in kids:
            assert kid.stdout.readline().strip() == "ready"
        for kid in kids:
            kid.send_signal(signal.SIGKILL)
            kid.wait(timeout=30)
    finally:
        for kid in kids:
            if kid.poll() is None:
                kid.kill()
    ends = []
    deadline = time.monotonic() + 30
    while len(ends) < 2 and time.monotonic() < deadline:
        ends = [line for line in server.log.splitlines() if "step stream cache=" in line
                and "CANCELLED after" in line]
        time.sleep(0.05)
    assert len(ends) == 2, server.log
    peers = {re.search(r" peer=(\S+) ", line).group(1) for line in ends}
    assert len(peers) == 2 and all(p.startswith("ipv4:127.0.0.1:") for p in peers), ends
    assert "peer=unknown" not in server.log
