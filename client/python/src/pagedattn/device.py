"""Device tensors: a CUDA server on the same node reads q/k/v from, and writes out/lse into,
the caller's torch CUDA tensors in place (RegisterMemory over CUDA IPC; no bytes on the wire).

    mem = client.register_memory(cache, buffer)   # buffer: any CUDA tensor of the allocation
    q, k, v, out = ...views of tensors in that allocation...
    torch.cuda.synchronize()                      # q/k/v written before the server reads them
    client.forward_device(cache, layer, spans, q, k, v, out, memory=mem)   # out is written
    mem.close()                                   # or leave it to the server's lease

torch's caching allocator hands out blocks of larger allocations; what is registered is the
whole allocation that holds `buffer` (torch's CUDA IPC handle names it), so every tensor later
carved from it can be named by offset."""

from __future__ import annotations

import inspect
from typing import Any, Optional

from .errors import NotFound
from .tensors import dtype_enum
from .types import checked_bool, checked_float, checked_int32
from .v1 import attention_pb2 as pb

ALIGN = 16  # the server's alignment of device tensor offsets


class DeviceMemory:
    """A registered allocation: region id, its device address range in this process, lease.
    Keep the tensors (and so the allocation) alive until close()."""

    def __init__(self, client: Any, region: pb.MemoryRegion, base: int, keep: Any) -> None:
        self._client = client
        self.region = region
        self.region_id = region.region_id
        self.base = base  # the allocation's start address in this process
        self.size = region.size_bytes
        self._keep = keep  # the storage, so the allocation outlives the registration

    def tensor(self, t: Any, name: str = "the tensor") -> pb.Tensor:
        """The pb.Tensor naming torch CUDA tensor `t` (contiguous, inside this allocation);
        `name` ("q") names it in errors."""
        if not getattr(t, "is_cuda", False):
            kind = type(t)
            raise ValueError(f"{name} must be a torch CUDA tensor (got "
                             f"{kind.__module__}.{kind.__qualname__}"
                             f"{' on ' + str(t.device) if hasattr(t, 'device') else ''})")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (its strides are {tuple(t.stride())}: "
                             "pass .contiguous())")
        offset = t.data_ptr() - self.base
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"{name} ({nbytes} bytes at address {t.data_ptr():#x}) lies outside region "
                f"{self.region_id} ({self.size} bytes at {self.base:#x})"
            )
        if offset % ALIGN:
            raise ValueError(f"{name} must start at a multiple of {ALIGN} bytes of the region "
                             f"(got offset {offset})")
        return pb.Tensor(
            dtype=dtype_enum(t.dtype), shape=list(t.shape),
            device_buffer=pb.DeviceBuffer(region_id=self.region_id, offset=offset),
        )

    def close(self, *, timeout: Optional[float] = None) -> Any:
        """Unregisters (the server's lease releases it otherwise); again, does nothing. With
        pagedattn.aio, await it. The allocation is let go once the server has let it go (or no
        longer knows it): a close() that failed otherwise may be retried."""
        if inspect.iscoroutinefunction(self._client.unregister_memory):
            return self._close_async(timeout)
        if self._keep is None:
            return None
        try:
            self._client.unregister_memory(self.region_id, timeout=timeout)
        except NotFound:
            self._keep = None  # gone already (its lease ran out, or its cache was deleted)
            raise
        self._keep = None
        return None

    async def _close_async(self, timeout: Optional[float]) -> None:
        if self._keep is None:
            return
        try:
            await self._client.unregister_memory(self.region_id, timeout=timeout)
        except NotFound:
            self._keep = None
            raise
        self._keep = None

    def __enter__(self) -> "DeviceMemory":
        if inspect.iscoroutinefunction(self._client.unregister_memory):
            raise TypeError("a pagedattn.aio client's DeviceMemory needs `async with`")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "DeviceMemory":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        result = self.close()
        if inspect.isawaitable(result):
            await result

    def __repr__(self) -> str:
        return f"DeviceMemory({self.region_id}, {self.size} bytes, device {self.region.device})"


def ipc_handle(buffer: Any) -> tuple[bytes, int, int, int, Any]:
    """(cudaIpcMemHandle_t bytes, device, allocation size used, the allocation's base address,
    the storage) of torch CUDA tensor `buffer`'s allocation."""
    if not getattr(buffer, "is_cuda", False):
        raise ValueError("register_memory takes a torch CUDA tensor")
    storage = buffer.untyped_storage()
    shared = storage._share_cuda_()  # (device, handle, size, offset in the allocation, ...)
    device, handle, size, offset = shared[0], bytes(shared[1]), int(shared[2]), int(shared[3])
    # torch counts the share as one its consumer will release; the server is no torch process,
    # so release it here (DeviceMemory keeps the storage alive instead), or torch warns at exit.
    try:
        type(storage)._release_ipc_counter_cuda(shared[4], shared[5])
    except Exception:  # noqa: BLE001 - an older or newer torch without it: only the warning
        pass
    return _cuda_malloc_handle(handle), int(device), offset + size, storage.data_ptr() - offset, storage


_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _cuda_malloc_handle(handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t inside torch's shareable handle: the raw 64 bytes (older torch),
    or a version byte, a type byte ('c': a cudaMalloc block) and the 64 bytes."""
    if len(handle) == _IPC_HANDLE_BYTES:
        return handle
    if len(handle) == _IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError(
            "this tensor lies in an expandable segment (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True), which has no cudaIpcMemHandle_t: allocate the tensors "
            "to register without expandable segments"
        )
    raise ValueError(f"unknown torch CUDA IPC handle format ({len(handle)} bytes)")


def register_request(
    cache_id: str, buffer: Any, lease_seconds: int
) -> tuple[pb.RegisterMemoryRequest, int, Any]:
    """RegisterMemory's request for the allocation holding `buffer`, its base address in this
    process, and the storage to keep alive."""
    lease_seconds = checked_int32("lease_seconds", lease_seconds)  # before the buffer's checks
    handle, dev, size, base, keep = ipc_handle(buffer)
    req = pb.RegisterMemoryRequest(cache_id=cache_id, cuda_ipc_handle=handle, size_bytes=size,
                                   device=dev, lease_seconds=lease_seconds)
    return req, base, keep


def device_request(
    memory: DeviceMemory, cache_id: str, layer: int, spans: list[pb.Span], q: Any, k: Any, v: Any,
    out: Any, lse: Any, causal: Optional[bool], sm_scale: Optional[float],
) -> pb.ForwardRequest:
    req = pb.ForwardRequest(cache_id=cache_id, layer=checked_int32("layer", layer), spans=spans)
    req.q.CopyFrom(memory.tensor(q, "q"))
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (or neither, when no span appends tokens)")
    if k is not None:
        req.k.CopyFrom(memory.tensor(k, "k"))
        req.v.CopyFrom(memory.tensor(v, "v"))
    req.out.CopyFrom(memory.tensor(out, "out"))
    if lse is not None:
        req.lse.CopyFrom(memory.tensor(lse, "lse"))
        req.options.return_lse = True
    if causal is not None:
        req.options.causal = checked_bool("causal", causal)
    if sm_scale is not None:
        req.options.sm_scale = checked_float("sm_scale", sm_scale)
    return req
