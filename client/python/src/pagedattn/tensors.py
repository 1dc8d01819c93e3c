"""Host arrays <-> pagedattn.v1.Tensor: numpy (float32, float16, bfloat16 through ml_dtypes) and
torch tensors, converted with whole-buffer copies (frombuffer/tobytes), never element by element."""

from __future__ import annotations

import sys
from typing import Any, Optional, Union

import numpy as np

from .v1 import attention_pb2 as pb

try:  # Optional: numpy's bfloat16 dtype.
    import ml_dtypes as _ml_dtypes

    BFLOAT16_NUMPY: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised where ml_dtypes is absent
    BFLOAT16_NUMPY = None

FLOAT32 = pb.FLOAT32
FLOAT16 = pb.FLOAT16
BFLOAT16 = pb.BFLOAT16
FLOAT8_E4M3 = pb.FLOAT8_E4M3  # a cache's kv_dtype only: tensors are float32/float16/bfloat16

# Anything that names a dtype: a DType enum value, a name ("bf16", "FLOAT16"), a numpy or torch dtype.
DTypeLike = Union[int, str, np.dtype, type, Any]
# A tensor argument: a numpy array or a torch.Tensor (CPU or CUDA).
ArrayLike = Any

_NAMES = {
    "float32": FLOAT32, "f32": FLOAT32, "fp32": FLOAT32, "float": FLOAT32,
    "float16": FLOAT16, "f16": FLOAT16, "fp16": FLOAT16, "half": FLOAT16,
    "bfloat16": BFLOAT16, "bf16": BFLOAT16,
    "float8_e4m3": FLOAT8_E4M3, "float8_e4m3fn": FLOAT8_E4M3, "fp8": FLOAT8_E4M3,
    "e4m3": FLOAT8_E4M3,
    "dtype_unspecified": pb.DTYPE_UNSPECIFIED, "unspecified": pb.DTYPE_UNSPECIFIED,
}
_ITEMSIZE = {FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2}
_LITTLE = sys.byteorder == "little"


def dtype_enum(dtype: DTypeLike) -> int:
    """The pagedattn.v1.DType value for `dtype` (enum value, name, numpy or torch dtype).

    DTYPE_UNSPECIFIED (0) passes through so that a config can be sent for validation as it is."""
    if isinstance(dtype, bool):
        raise TypeError(f"not a dtype: {dtype!r}")
    if isinstance(dtype, int):
        if dtype not in (pb.DTYPE_UNSPECIFIED, FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3):
            raise ValueError(f"unknown pagedattn DType value {dtype}")
        return int(dtype)
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name in _NAMES:
            return _NAMES[name]
        raise ValueError(f"unknown dtype name {dtype!r} (use float32, float16, bfloat16, or "
                         "float8_e4m3 for a cache)")
    if type(dtype).__module__ == "torch":  # a torch.dtype, without importing torch
        return dtype_enum(str(dtype))
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"not a dtype: {dtype!r}") from None
    if np_dtype.name in _NAMES:
        return _NAMES[np_dtype.name]
    raise TypeError(f"pagedattn tensors are float32, float16 or bfloat16 (got {np_dtype})")


def dtype_name(dtype: DTypeLike) -> str:
    """'float32', 'float16', 'bfloat16', 'float8_e4m3' or 'dtype_unspecified'."""
    return pb.DType.Name(dtype_enum(dtype)).lower()


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32. Vectorized."""
    return bfloat16_bits_to_float32(float32_to_bfloat16_bits(x))


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """The uint16 bit patterns of `x` rounded to bfloat16 (round to nearest even; NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    bits = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        bits[nan] = np.uint16(0x7FC0)
    return bits


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16/int16) widened exactly to float32."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _numpy_raw(x: Any, want: Optional[int], name: str) -> tuple[int, np.ndarray]:
    """(DType, a C-contiguous little-endian array whose bytes are the wire data)."""
    arr = np.asarray(x)
    if BFLOAT16_NUMPY is not None and arr.dtype == BFLOAT16_NUMPY:
        have = BFLOAT16
    elif arr.dtype.kind == "f" and arr.dtype.itemsize in (4, 8):
        have = FLOAT32
        arr = arr.astype(np.float32, copy=False)  # float64 travels as float32
    elif arr.dtype.kind == "f" and arr.dtype.itemsize == 2:
        have = FLOAT16
    else:
        raise TypeError(f"{name} dtype must be float32, float16 or bfloat16 (got {arr.dtype})")
    if want is not None and want != have:
        if want == BFLOAT16:
            if BFLOAT16_NUMPY is not None:
                arr = arr.astype(BFLOAT16_NUMPY)
            else:
                arr = float32_to_bfloat16_bits(arr.astype(np.float32))
        else:
            src = bfloat16_bits_to_float32(arr.view(np.uint16)) if have == BFLOAT16 else arr
            arr = src.astype(np.float32 if want == FLOAT32 else np.float16)
        have = want
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return have, np.ascontiguousarray(arr)


def _torch_raw(t: Any, want: Optional[int], name: str) -> tuple[int, np.ndarray]:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # CUDA tensors travel through host memory (for now)
    if t.dtype == torch.float64:
        t = t.float()
    if want is not None:
        t = t.to({FLOAT32: torch.float32, FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}[want])
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return BFLOAT16, t.view(torch.int16).numpy()
    if t.dtype == torch.float32:
        return FLOAT32, t.numpy()
    if t.dtype == torch.float16:
        return FLOAT16, t.numpy()
    raise TypeError(f"{name} dtype must be float32, float16 or bfloat16 (got {t.dtype})")


def to_tensor(x: ArrayLike, dtype: Optional[DTypeLike] = None) -> pb.Tensor:
    """A pagedattn.v1.Tensor holding `x` (numpy array or torch tensor; float64 is sent as float32).

    `dtype` converts before sending (e.g. float32 data sent as bfloat16 halves the bytes)."""
    t = pb.Tensor()
    fill_tensor(t, x, dtype)
    return t


MAX_DIMS = 8  # of a tensor the server parses


def fill_tensor(t: pb.Tensor, x: ArrayLike, dtype: Optional[DTypeLike] = None,
                name: str = "tensor") -> None:
    """Sets the Tensor message `t` (e.g. request.q) in place: no copy of a whole message.
    `name` (e.g. "q") names the argument in errors."""
    want = None if dtype is None else dtype_enum(dtype)
    if want == pb.DTYPE_UNSPECIFIED:
        raise ValueError(f"dtype {dtype!r} is no tensor dtype: float32, float16 or bfloat16 (or "
                         f"None: {name}'s own)")
    if want == FLOAT8_E4M3:
        raise TypeError("float8_e4m3 is a cache's kv_dtype; tensors travel as float32, float16 or "
                        "bfloat16 (an FP8 cache converts them when it appends)")
    enum, raw = _torch_raw(x, want, name) if _is_torch(x) else _numpy_raw(x, want, name)
    if raw.ndim > MAX_DIMS:  # the server's parse refuses it, ending a Step stream's open step
        raise ValueError(f"{name} has {raw.ndim} dimensions; a tensor has at most {MAX_DIMS} "
                         f"(shape {raw.shape})")
    t.dtype = enum
    t.shape[:] = raw.shape
    t.data = raw.tobytes()


def _checked_numpy(t: pb.Tensor) -> tuple[int, tuple[int, ...], np.ndarray]:
    if t.dtype not in _ITEMSIZE:
        raise ValueError(f"tensor has no valid dtype (got {t.dtype})")
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor has a negative dimension: {shape}")
    count = int(np.prod(shape, dtype=np.int64))
    if len(t.data) != count * _ITEMSIZE[t.dtype]:
        raise ValueError(
            f"tensor holds {len(t.data)} bytes, its shape {shape} needs {count * _ITEMSIZE[t.dtype]}"
        )
    wire = {FLOAT32: "<f4", FLOAT16: "<f2", BFLOAT16: "<u2"}[t.dtype]
    # One copy out of the (immutable) message bytes, so the result is writable.
    return t.dtype, shape, np.frombuffer(t.data, dtype=wire).copy()


def to_numpy(t: pb.Tensor) -> np.ndarray:
    """The tensor as a writable numpy array of its shape: float32, float16, or bfloat16 as
    ml_dtypes.bfloat16 (float32 holding the exact values when ml_dtypes is not installed)."""
    enum, shape, flat = _checked_numpy(t)
    if enum == BFLOAT16:
        flat = flat.view(BFLOAT16_NUMPY) if BFLOAT16_NUMPY is not None else bfloat16_bits_to_float32(flat)
    return flat.astype(flat.dtype.newbyteorder("="), copy=False).reshape(shape)


def to_torch(t: pb.Tensor, device: Any = None) -> Any:
    """The tensor as a torch.Tensor of its shape and dtype (bfloat16 without ml_dtypes), on `device`."""
    import torch

    enum, shape, flat = _checked_numpy(t)
    if enum == BFLOAT16:
        out = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(flat.astype(flat.dtype.newbyteorder("="), copy=False))
    out = out.reshape(shape)
    if device is not None and torch.device(device).type != "cpu":
        out = out.to(device, non_blocking=False)
    return out


def from_tensor(t: pb.Tensor, like: Any = None) -> Any:
    """The tensor as the same kind of array as `like`: torch (on like's device) or numpy."""
    if _is_torch(like):
        return to_torch(t, like.device)
    return to_numpy(t)
