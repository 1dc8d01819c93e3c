"""Device tensors from torch CUDA tensors (Client.register_memory / forward_device): the server
(another process, on the same GPU) reads q/k/v and writes out/lse in place. The answers must be
bit-identical to forward() with the same tensors sent as bytes. Needs a CUDA server and torch
with CUDA; on a CPU server, registering is refused with FailedPrecondition."""

import asyncio

import grpc
import pytest

import pagedattn
from pagedattn import errors, pb

CONFIG = pagedattn.CacheConfig(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=128,
                               page_size=16, kv_dtype="bfloat16", num_pages=64)


def cuda_torch(backend, wanted, why):
    """torch with CUDA, on a server of the `wanted` backend; skips the test otherwise."""
    if backend != wanted:
        pytest.skip(why)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA in this torch")
    return torch


def test_torch_handles_are_unwrapped():
    from pagedattn.device import _cuda_malloc_handle

    raw = bytes(range(64))
    assert _cuda_malloc_handle(raw) == raw
    assert _cuda_malloc_handle(b"\x02c" + raw) == raw
    with pytest.raises(ValueError, match="expandable segment"):
        _cuda_malloc_handle(b"\x02e" + raw + b"\0" * 16)
    with pytest.raises(ValueError, match="unknown"):
        _cuda_malloc_handle(b"\x02x" + raw)


def test_a_tensor_not_on_the_device_is_named():
    """A device Forward's tensor that is not a contiguous torch CUDA tensor is refused naming
    the field and what it is (no GPU needed: refused before any call)."""
    import numpy as np
    from pagedattn.device import DeviceMemory, device_request

    memory = DeviceMemory(None, pagedattn.pb.MemoryRegion(region_id="r", size_bytes=1 << 20), 0,
                          None)
    host = np.zeros((1, 8, 128), np.float32)
    with pytest.raises(ValueError, match=r"^q must be a torch CUDA tensor \(got numpy\.ndarray"):
        device_request(memory, "c", 0, [], host, None, None, host, None, None, None)


class _Unregisters:
    """A client's unregister_memory, failing as told (no GPU needed)."""

    def __init__(self, *failures):
        self.calls, self.failures = [], list(failures)

    def unregister_memory(self, region_id, *, timeout=None):
        self.calls.append(region_id)
        if self.failures:
            raise self.failures.pop(0)


def test_a_failed_close_keeps_the_allocation_for_a_retry():
    """A close() whose UnregisterMemory failed (UNAVAILABLE) keeps the allocation alive (the
    server still maps it) and may be retried; it let go of it first, and the retry did nothing."""
    from pagedattn.device import DeviceMemory

    client = _Unregisters(errors.Unavailable("down", grpc.StatusCode.UNAVAILABLE))
    storage = object()
    mem = DeviceMemory(client, pb.MemoryRegion(region_id="r1", size_bytes=64), 0, storage)
    with pytest.raises(errors.Unavailable):
        mem.close()
    assert mem._keep is storage
    mem.close()
    mem.close()  # closed: nothing sent
    assert client.calls == ["r1", "r1"] and mem._keep is None
    gone = _Unregisters(errors.NotFound("no region r2", grpc.StatusCode.NOT_FOUND))
    mem = DeviceMemory(gone, pb.MemoryRegion(region_id="r2", size_bytes=64), 0, storage)
    with pytest.raises(errors.NotFound):
        mem.close()
    assert mem._keep is None  # the server no longer knows it: nothing to keep it for


def test_an_aio_clients_memory_closes_with_async_with():
    """With pagedattn.aio, `async with mem:` unregisters (it was unsupported) and `with mem:` is
    refused (it unregistered nothing: an un-awaited coroutine); a second close is awaitable."""
    from pagedattn.device import DeviceMemory

    class AioUnregisters:
        calls = []

        async def unregister_memory(self, region_id, *, timeout=None):
            self.calls.append(region_id)

    mem = DeviceMemory(AioUnregisters(), pb.MemoryRegion(region_id="r1", size_bytes=64), 0, 1)
    with pytest.raises(TypeError, match="async with"):
        with mem:
            pass

    async def main():
        async with mem:
            pass
        await mem.close()

    asyncio.run(main())
    assert AioUnregisters.calls == ["r1"]


def test_cpu_server_refuses_device_memory(client, backend):
    torch = cuda_torch(backend, "cpu", "the CPU backend's refusal")
    with client.create_cache(CONFIG) as cache:
        with pytest.raises(pagedattn.FailedPrecondition, match="CUDA backend"):
            client.register_memory(cache, torch.zeros(16, device="cuda"))


def test_forward_device_matches_bytes(client, backend):
    torch = cuda_torch(backend, "cuda", "device tensors need a CUDA server")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # One allocation holds every tensor: carve views out of it.
    pool = torch.empty(1 << 22, dtype=torch.bfloat16, device="cuda")
    at = 0

    def carve(*shape):
        nonlocal at
        n = 1
        for d in shape:
            n *= d
        t = pool[at:at + n].view(*shape)
        at += (n + 63) // 64 * 64  # 128-byte steps
        return t

    with client.create_cache(CONFIG) as ref, client.create_cache(CONFIG) as dev:
        mem = client.register_memory(dev, pool)
        assert dev.refresh().stats.memory_regions == 1
        steps = [([(1, 0, 37, 37), (2, 0, 9, 9)], 46, 46),   # prefill
                 ([(1, 37, 1, 1), (2, 9, 1, 1)], 2, 2),      # decode
                 ([(1, 30, 3, 3), (2, 10, 0, 2)], 3, 5)]     # rewind, attend only
        for layer in (0, 1):
            for spans, new, queries in steps:
                q = carve(queries, 8, 128)
                k, v = carve(new, 2, 128), carve(new, 2, 128)
                for t in (q, k, v):
                    t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
                out = carve(queries, 8, 128).fill_(float("nan"))
                lse = torch.full((queries, 8), float("nan"), device="cuda")
                want, want_lse = ref.forward(layer, spans, q, k, v, return_lse=True)
                torch.cuda.synchronize()
                with pytest.raises(ValueError, match="outside region"):
                    client.forward_device(dev, layer, spans, q, k, v, out, lse, memory=mem)
                lse = carve(queries * 8 * 2).view(torch.float32).view(queries, 8)
                lse.fill_(float("nan"))
                client.forward_device(dev, layer, spans, q, k, v, out, lse, memory=mem)
                assert torch.equal(out, want.to(out.device)), "out differs from the byte path"
                assert torch.equal(lse, want_lse.to(lse.device))
        mem.close()
        assert dev.refresh().stats.memory_regions == 0
        with pytest.raises(pagedattn.NotFound, match="register the memory again"):
            client.forward_device(dev, 0, [(1, 40, 0, 1)], q[:1], None, None, out[:1],
                                  memory=mem)


def test_aio_forward_device(target, backend):
    torch = cuda_torch(backend, "cuda", "device tensors need a CUDA server")
    import asyncio

    import pagedattn.aio

    async def run():
        async with pagedattn.aio.Client(target) as client:
            cache = await client.create_cache(CONFIG)
            pool = torch.zeros(1 << 16, dtype=torch.bfloat16, device="cuda")
            q, k, v, out = (pool[i * 4096:(i + 1) * 4096].view(4, 8, 128)[:1] for i in range(4))
            k, v = k.view(-1)[:256].view(1, 2, 128), v.view(-1)[:256].view(1, 2, 128)
            for t in (q, k, v):
                t.normal_()
            mem = await client.register_memory(cache, pool)
            torch.cuda.synchronize()
            await client.forward_device(cache, 0, [(1, 0, 1, 1)], q, k, v, out, memory=mem)
            await mem.close()
            # One token attends itself: the output is its v, repeated over the GQA group.
            assert torch.allclose(out[0, :4].float(), v[0, 0].float().expand(4, 128))
            await cache.delete()

    asyncio.run(run())
