"""Errors without a server: the exception type and attributes for each google.rpc.Status the
server sends (ErrorInfo reasons and their numbers, BadRequest violations, message-only), and the
values the client checks by name before sending (spans, sequence ids)."""

from __future__ import annotations

import pickle
import re

import grpc
import numpy as np
import pytest

from pagedattn import errors
from pagedattn._vendor.google.rpc import error_details_pb2, status_pb2

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def status_with_info(code: int, message: str, reason: str, numbers: dict[str, int]):
    info = error_details_pb2.ErrorInfo(reason=reason, domain="pagedattn",
                                       metadata={k: str(v) for k, v in numbers.items()})
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(info)
    return status


@pytest.mark.parametrize("reason,numbers", [
    ("SERVER_BUSY", {"bytes_in_flight": 900, "bytes_needed": 300, "budget_bytes": 1000}),
    ("RESPONSE_TOO_LARGE", {"response_bytes": 6 << 20, "max_message_bytes": 4 << 20}),
    ("REQUEST_TOO_LARGE", {"request_bytes": (8 << 20) + 1, "max_request_bytes": 8 << 20}),
    ("SEQUENCE_TOO_LONG", {"sequence_length": 13, "capacity_tokens": 12}),
    ("TOO_MANY_CACHES", {"max_caches": 4}),
])
def test_error_info_numbers_are_attributes_and_the_rest_none(reason, numbers):
    err = errors.from_status(status_with_info(RESOURCE_EXHAUSTED, "m", reason, numbers))
    assert type(err) is errors.ResourceExhausted
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == reason
    for name, value in numbers.items():
        assert getattr(err, name) == value
    # Every number any case carries is an attribute: None where this case has none.
    for name in errors.ResourceExhausted.__annotations__:
        if name not in numbers and name != "reason":
            assert getattr(err, name) is None, name


def test_out_of_pages_is_its_own_type():
    numbers = {"pages_needed": 3, "free_pages": 1, "total_pages": 3, "page_size": 4}
    err = errors.from_status(status_with_info(RESOURCE_EXHAUSTED, "m", "OUT_OF_PAGES", numbers))
    assert type(err) is errors.OutOfPages
    assert (err.pages_needed, err.free_pages, err.total_pages, err.page_size) == (3, 1, 3, 4)
    assert err.response_bytes is None and err.bytes_in_flight is None


def test_message_numbers_without_error_info():
    # gRPC's own limit on a message carries no ErrorInfo: the numbers come from its text.
    status = status_pb2.Status(
        code=RESOURCE_EXHAUSTED,
        message="Received message larger than max (5242890 vs. 4194304)")
    err = errors.from_status(status)
    assert type(err) is errors.ResourceExhausted and err.reason is None
    assert (err.message_bytes, err.max_message_bytes) == (5242890, 4194304)
    assert err.budget_bytes is None
    # A server's own messages, one of a kind said in the singular, without ErrorInfo (as from
    # an older server): the numbers still come from the text.
    for message, numbers in (
            ("out of KV pages: this Forward needs 1 more page of 1 token, 0 of 1 are free",
             {"pages_needed": 1, "page_size": 1, "free_pages": 0, "total_pages": 1}),
            ("at most 1 cache per tenant (--max_caches_per_tenant); delete one first",
             {"max_caches": 1}),
            ("the pool needs 4096 bytes (1 pages x 4096 bytes) but only 100 bytes are free in "
             "host memory (the CPU backend's); at most 0 pages",
             {"free_bytes": 100, "max_pages": 0, "device": None})):
        err = errors.from_status(status_pb2.Status(code=RESOURCE_EXHAUSTED, message=message))
        assert {k: getattr(err, k) for k in numbers} == numbers, message


def test_bad_request_violations():
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="page_size", description="must be one of 1..1024 (got 0)")
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")
    status.details.add().Pack(bad)
    err = errors.from_status(status)
    assert type(err) is errors.CacheConfigError
    assert err.fields == ["page_size"] and "(got 0)" in dict(err.violations)["page_size"]


def test_errors_survive_pickling():
    """An error raised in a process pool's worker comes back pickled: its type, message, code,
    status and numbers with it (CacheConfigError could not be unpickled: the pool broke)."""
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="head_dim", description="must be one of 64, 128 (got 100)")
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")
    status.details.add().Pack(bad)
    full = status_with_info(RESOURCE_EXHAUSTED, "busy", "SERVER_BUSY",
                            {"bytes_in_flight": 900, "bytes_needed": 300, "budget_bytes": 1000})
    for err in (errors.from_status(status), errors.from_status(full),
                errors.PagedAttnError("gone", grpc.StatusCode.NOT_FOUND)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert (back.code, back.status) == (err.code, err.status)
        assert vars(back) == vars(err)
    assert pickle.loads(pickle.dumps(errors.from_status(status))).fields == ["head_dim"]


def test_span_and_seq_id_values_are_checked_by_name():
    from pagedattn import Span
    from pagedattn.types import seq_id_list, sequence_lengths, span_protos

    with pytest.raises(ValueError, match=r"Span.seq_id must be in 0\.\.18446744073709551615 \(got -1\)"):
        Span.decode(-1, 0)
    with pytest.raises(TypeError, match=r"Span.num_new_tokens must be an int \(got float 1.5\)"):
        Span(1, 0, 1.5, 1)
    with pytest.raises(TypeError, match="Span.start must be an int"):
        Span(1, True, 1, 1)  # a bool is not a position
    assert Span(np.uint64(7), np.int32(0), 1, 1).to_proto().seq_id == 7  # numpy ints are ints
    # num_new_tokens and num_queries are int32 on the wire, start int64.
    with pytest.raises(ValueError, match=r"Span.num_new_tokens must be in -2147483648\.\.2147483647 "
                                         r"\(got 2147483648\)"):
        Span(1, 0, 2**31, 1)
    with pytest.raises(ValueError, match=r"Span.num_queries must be in -2147483648\.\."):
        span_protos([(1, 0, 1, -(2**31) - 1)])
    assert Span(1, 2**40, 2**31 - 1, 2**31 - 1).to_proto().num_queries == 2**31 - 1
    with pytest.raises(ValueError, match=r"seq_ids\[1\] must be in 0\.\."):
        seq_id_list([3, -5])
    with pytest.raises(ValueError, match="seq_id must be in 0"):
        sequence_lengths({-1: 2})
    assert [x.length for x in sequence_lengths({4: 2})] == [2]
    # RegisterMemory's lease is int32 too: named before the buffer is looked at (no GPU needed).
    from pagedattn.device import register_request
    with pytest.raises(ValueError, match=r"lease_seconds must be in -2147483648\.\.2147483647 "
                                         r"\(got 2147483648\)"):
        register_request("cache", object(), 2**31)


def test_misused_arguments_name_what_is_wrong():
    import pagedattn
    from pagedattn import CacheConfig, LayerAttention, Span
    from pagedattn.types import span_protos

    with pytest.raises(TypeError, match=r"spans is a list of spans \(got one span"):
        span_protos(Span.decode(1, 0))
    layered = CacheConfig(2, 4, 2, 64, page_size=4, num_pages=4, layers=[{"sliding_window": 4}])
    with pytest.raises(TypeError, match=r"layers\[0\] must be a pagedattn.LayerAttention"):
        layered.to_proto()
    one = CacheConfig(2, 4, 2, 64, page_size=4, num_pages=4, layers=LayerAttention(sliding_window=4))
    with pytest.raises(TypeError, match="layers is a list of LayerAttention"):
        one.to_proto()
    for bad in ("5", 0, -1.0, True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            pagedattn.Client("127.0.0.1:1", timeout=bad)


@pytest.mark.parametrize("target,message", [
    # grpc connected to 127.0.0.1:34463 (99999 modulo 65536).
    ("127.0.0.1:99999", "target '127.0.0.1:99999': the port is out of range"),
    ("[::1]:70000", "target '[::1]:70000': the port is out of range"),
    ("localhost:http", "target 'localhost:http': the port is not a number"),
    ("::1:50051", "target '::1:50051': an IPv6 address needs [brackets]"),
    ("", "target is required: host:port, unix:PATH or a gRPC URI"),
    # A dns: URI's port wraps the same way.
    ("dns:///localhost:99999", "target 'dns:///localhost:99999': the port is out of range"),
    ("dns:localhost:99999", "target 'dns:localhost:99999': the port is out of range"),
])
def test_a_target_grpc_would_misread_is_refused(target, message):
    import asyncio

    import pagedattn
    from pagedattn import aio

    with pytest.raises(ValueError) as e:
        pagedattn.Client(target)
    assert str(e.value) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        pagedattn.ShardedClient([target, "127.0.0.1:1"])

    async def make():
        aio.Client(target)

    with pytest.raises(ValueError, match=re.escape(message)):
        asyncio.run(make())
    # What grpc reads as the caller meant stays accepted.
    for fine in ("localhost:50051", "[::1]:50051", ":50051", "unix:/run/pa.sock", "dns:///h:1",
                 "ipv4:127.0.0.1:1", "localhost", "dns:///[::1]", "dns:///h:https"):
        pagedattn.Client(fine).close()


@pytest.mark.parametrize("kwargs,error,message", [
    # grpc took 1e9 and 1.5 without a word and kept its 4 MiB receive limit; None failed in grpc.
    ({"max_message_bytes": 1e9}, TypeError, "max_message_bytes must be an int, in bytes (got float"),
    ({"max_message_bytes": None}, TypeError, "max_message_bytes must be an int, in bytes (got None"),
    ({"max_message_bytes": True}, TypeError, "max_message_bytes must be an int"),
    ({"max_message_bytes": 0}, ValueError,
     "max_message_bytes must be in 1..2147483647, or -1 for no limit (got 0)"),
    ({"max_message_bytes": 2**31}, ValueError, "max_message_bytes must be in 1..2147483647"),
    # One pair instead of a list of pairs: "too many values to unpack" from the library.
    ({"options": ("grpc.enable_retries", 0)}, TypeError,
     "options[0] must be a (name, value) pair with a str name"),
    ({"options": {"grpc.enable_retries": 0}}, TypeError, "options must be a list of (name, value)"),
    ({"options": None}, TypeError, "options must be a list of (name, value) pairs"),
    ({"options": [("a", 1, 2)]}, TypeError, "options[0] must be a (name, value) pair"),
])
def test_channel_arguments_are_named_when_the_client_is_made(kwargs, error, message):
    import asyncio

    import pagedattn
    from pagedattn import aio

    with pytest.raises(error, match=re.escape(message)):
        pagedattn.Client("127.0.0.1:1", **kwargs)
    with pytest.raises(error, match=re.escape(message)):
        pagedattn.ShardedClient(["127.0.0.1:1", "127.0.0.1:2"], **kwargs)

    async def make():
        aio.Client("127.0.0.1:1", **kwargs)

    with pytest.raises(error, match=re.escape(message)):
        asyncio.run(make())


def test_channel_arguments_grpc_takes_stay_accepted(monkeypatch):
    import grpc as grpc_module

    import pagedattn

    seen = []
    real = grpc_module.insecure_channel
    monkeypatch.setattr(grpc_module, "insecure_channel",
                        lambda target, options=None: seen.append(options) or real(target, options))
    # -1 (gRPC's no limit), a numpy int (passed on as an int), pairs as lists.
    pagedattn.Client("127.0.0.1:1", max_message_bytes=np.int64(2**20),
                     options=[["grpc.enable_retries", 0]]).close()
    assert ("grpc.max_receive_message_length", 2**20) in seen[-1]
    assert type(dict(seen[-1])["grpc.max_receive_message_length"]) is int
    assert ("grpc.enable_retries", 0) in seen[-1]
    pagedattn.Client("127.0.0.1:1", max_message_bytes=-1).close()
    # Options from a generator reach every shard, not the first alone.
    seen.clear()
    pagedattn.ShardedClient(["127.0.0.1:1", "127.0.0.1:2"],
                            options=(p for p in [("grpc.enable_retries", 0)])).close()
    assert len(seen) == 2 and all(("grpc.enable_retries", 0) in o for o in seen), seen


def test_arguments_the_client_checks_are_named_before_sending():
    # No server at 127.0.0.1:1: each is refused before an RPC (a call would be UNAVAILABLE).
    import asyncio

    import pagedattn
    from pagedattn import aio

    config = pagedattn.CacheConfig(2, 4, 2, 64, page_size=4, num_pages=4)
    client = pagedattn.Client("127.0.0.1:1")
    with pytest.raises(TypeError, match=re.escape("name must be a str (got int 5)")):
        client.create_cache(config, name=5)
    sharded = pagedattn.ShardedClient(["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(TypeError, match="name must be a str"):  # before ValidateCacheConfig
        sharded.create_cache(config, name=5)
    q = np.zeros((1, 2, 64), np.float32)
    with pytest.raises(TypeError, match=re.escape("spans is a list of spans: Span, pagedattn.v1 "
                                                  "Span or (seq_id, start, num_new_tokens, "
                                                  "num_queries) (got NoneType)")):
        client.forward("c", 0, None, q)
    for dtype in (0, "unspecified"):
        # Sent as float16 with no dtype set, which the server blamed on q.
        with pytest.raises(ValueError, match=re.escape(f"dtype {dtype!r} is no tensor dtype")):
            client.forward("c", 0, [pagedattn.Span.attend(1, 1)], q, dtype=dtype)

    async def aio_name():
        c = aio.Client("127.0.0.1:1")
        with pytest.raises(TypeError, match="name must be a str"):
            await c.create_cache(config, name=b"x")
        await c.close()
        s = aio.ShardedClient(["127.0.0.1:1", "127.0.0.1:2"])
        with pytest.raises(TypeError, match="name must be a str"):
            await s.create_cache(config, name=None)
        await s.close()

    asyncio.run(aio_name())
    client.close()
    sharded.close()


def test_unavailable_from_a_target_without_a_port_says_grpc_dialed_443():
    # (Nothing listens on 127.0.0.1:443 where the tests run: the call is refused at once.)
    import asyncio

    import pagedattn
    from pagedattn import aio

    hint = "(the target '127.0.0.1' names no port: gRPC dials 443; give host:port)"
    with pagedattn.Client("127.0.0.1", timeout=5) as client:
        with pytest.raises(errors.Unavailable) as e:
            client.health()
        assert str(e.value).endswith(hint)

    async def health():
        async with aio.Client("127.0.0.1", timeout=5) as c:
            with pytest.raises(errors.Unavailable, match=re.escape(hint)):
                await c.health()

    asyncio.run(health())
    with pagedattn.Client("dns:///127.0.0.1", timeout=5) as client:
        with pytest.raises(errors.Unavailable, match="names no port: gRPC dials 443"):
            client.health()
    with pagedattn.Client("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(errors.Unavailable) as e:
            client.health()
        assert "names no port" not in str(e.value)


def test_a_closed_client_raises_client_closed_before_sending():
    # No server: a call on a closed channel never reaches one, and grpc's own ValueError ("Cannot
    # invoke RPC on closed channel!") is not what a caller catching PagedAttnError expects.
    import asyncio

    import pagedattn
    from pagedattn import aio

    client = pagedattn.Client("127.0.0.1:1")
    client.close()
    with pytest.raises(errors.ClientClosed, match="127.0.0.1:1 is closed") as e:
        client.health()
    assert isinstance(e.value, errors.PagedAttnError) and e.value.code is None
    with pytest.raises(errors.ClientClosed):
        client.step("cache", [pagedattn.Span(1, 0, 1, 1)])

    sharded = pagedattn.ShardedClient(["127.0.0.1:1", "127.0.0.1:2"])
    sharded.close()
    answers = sharded.fan_out("GetServerInfo", [pagedattn.pb.GetServerInfoRequest()] * 2)
    assert [type(a) for a in answers] == [errors.ClientClosed] * 2

    async def closed_aio():
        c = aio.Client("127.0.0.1:1")
        await c.close()
        with pytest.raises(errors.ClientClosed, match="async with"):
            await c.health()
        with pytest.raises(errors.ClientClosed):
            async with c.step("cache", [pagedattn.Span(1, 0, 1, 1)]) as s:
                await s.forward(0, np.zeros((1, 1, 64), np.float32), np.zeros((1, 1, 64), np.float32),
                                np.zeros((1, 1, 64), np.float32))

    asyncio.run(closed_aio())


@pytest.mark.parametrize("kwargs,message", [
    ({"layer": 1.5}, "layer must be an int (got float 1.5)"),
    ({"layer": "0"}, "layer must be an int (got str '0')"),
    ({"causal": "yes"}, "causal must be True or False (got str 'yes')"),
    ({"return_lse": 1}, "return_lse must be True or False (got int 1)"),
    ({"sm_scale": "x"}, "sm_scale must be a number (got str 'x')"),
    ({"timeout": "x"}, "timeout must be a positive number of seconds, math.inf for no deadline or "
                       "None (got 'x')"),
])
def test_scalar_arguments_are_named_before_sending(kwargs, message):
    # No server: each is refused before an RPC, by its argument's name (protobuf's own message
    # was "'str' object cannot be interpreted as an integer").
    import pagedattn

    client = pagedattn.Client("127.0.0.1:1")
    args = {"layer": 0, **kwargs}
    layer = args.pop("layer")
    q = np.zeros((1, 2, 64), np.float32)
    kv = np.zeros((1, 1, 64), np.float32)
    with pytest.raises((TypeError, ValueError)) as e:
        client.forward("c", layer, [pagedattn.Span.prefill(1, 1)], q, kv, kv, **args)
    assert str(e.value) == message
    if "timeout" not in kwargs:
        with pytest.raises(TypeError, match=message.split(" (")[0]):
            step = client.step("c", [pagedattn.Span.prefill(1, 1)], **{
                k: v for k, v in args.items() if k != "layer"})
            step.forward(layer, q, kv, kv)
    client.close()


@pytest.mark.parametrize("field,value,message", [
    ("head_dim", "64", "CacheConfig.head_dim must be an int (got str '64')"),
    ("num_pages", 5.0, "CacheConfig.num_pages must be an int (got float 5.0)"),
    ("num_layers", 2**31, "CacheConfig.num_layers must be in -2147483648..2147483647"),
    ("kv_scales", ["1"], "CacheConfig.kv_scales[0] must be a number (got str '1')"),
    ("kv_scales", [1.0, 1e39], "CacheConfig.kv_scales[1] is 1e+39, outside float32's range"),
    ("kv_scales", [1e-50, 1.0], "CacheConfig.kv_scales[0] is 1e-50, outside float32's range"),
    ("kv_scales", 0.5, "CacheConfig.kv_scales must be a sequence of numbers (got float 0.5)"),
    ("kv_scales", "0.5,1", "CacheConfig.kv_scales must be a sequence of numbers (got str '0.5,1')"),
    ("kv_dtype", None, "CacheConfig.kv_dtype must be float16, bfloat16, float32 or float8_e4m3 "
     "(got None)"),
    ("kv_dtype", "int8", "CacheConfig.kv_dtype must be float16, bfloat16, float32 or "
     "float8_e4m3 (got 'int8')"),
])
def test_config_fields_are_named_before_sending(field, value, message):
    import pagedattn
    from pagedattn.types import config_proto

    config = pagedattn.CacheConfig(**{"num_layers": 2, "num_q_heads": 2, "num_kv_heads": 1,
                                      "head_dim": 64, "page_size": 16, field: value})
    with pytest.raises((TypeError, ValueError)) as e:
        config_proto(config)
    assert str(e.value).startswith(message)
    window = pagedattn.LayerAttention(sliding_window=4.5)
    with pytest.raises(TypeError, match="LayerAttention.sliding_window must be an int"):
        window.to_proto()
    with pytest.raises(TypeError, match=r"^LayerAttention.sinks must be a sequence of numbers "
                       r"\(got float 1.0\)"):
        pagedattn.LayerAttention(sinks=1.0)
