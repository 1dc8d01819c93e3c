"""pagedattn.tensors without a server: dtype names, bfloat16 bit conversions against ml_dtypes,
Tensor round trips, malformed tensors, and the private descriptor pool (no google.rpc needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from google.protobuf import descriptor_pool

import pagedattn
from pagedattn import pb, tensors
from pagedattn.tensors import BFLOAT16, FLOAT16, FLOAT32, dtype_enum, to_numpy, to_tensor


def test_dtype_names():
    for name, want in [("bf16", BFLOAT16), ("FLOAT16", FLOAT16), ("float32", FLOAT32),
                       ("torch.bfloat16", BFLOAT16), ("half", FLOAT16)]:
        assert dtype_enum(name) == want
    assert dtype_enum(np.float16) == FLOAT16
    assert dtype_enum(ml_dtypes.bfloat16) == BFLOAT16
    assert dtype_enum(pb.FLOAT32) == FLOAT32
    with pytest.raises(ValueError):
        dtype_enum("int8")
    with pytest.raises(TypeError):
        dtype_enum(np.int32)


def test_bfloat16_bits_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, np.inf, -np.inf, 1.00390625, 1.01171875], np.float32)])
    ours = tensors.float32_to_bfloat16_bits(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(tensors.bfloat16_bits_to_float32(ours), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.isnan(tensors.bfloat16_bits_to_float32(tensors.float32_to_bfloat16_bits(np.array([np.nan], np.float32))))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_numpy_round_trip(dtype):
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(dtype)
    t = to_tensor(x)
    assert list(t.shape) == [3, 4, 5] and len(t.data) == x.nbytes
    y = to_numpy(t)
    assert y.dtype == x.dtype and y.flags.writeable
    np.testing.assert_array_equal(y, x)


def test_conversions_on_the_way_in():
    x = np.random.default_rng(2).standard_normal((2, 3))  # float64 travels as float32
    assert to_tensor(x).dtype == FLOAT32
    t = to_tensor(x.astype(np.float32), dtype="bfloat16")
    assert t.dtype == BFLOAT16
    np.testing.assert_array_equal(to_numpy(t), x.astype(np.float32).astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(to_numpy(to_tensor(to_numpy(t), dtype="float32")),
                                  x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))
    big_endian = x.astype(">f4")
    np.testing.assert_array_equal(to_numpy(to_tensor(big_endian)), x.astype(np.float32))


def test_malformed_tensors_are_rejected():
    with pytest.raises(ValueError, match="needs 24"):
        to_numpy(pb.Tensor(dtype=FLOAT32, shape=[2, 3], data=b"\0" * 20))
    with pytest.raises(ValueError, match="no valid dtype"):
        to_numpy(pb.Tensor(shape=[1], data=b"\0" * 4))


def test_torch_round_trip_without_ml_dtypes_paths():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 2, 8).to(torch.bfloat16)
    t = to_tensor(x[:, :, ::2])  # non-contiguous
    y = tensors.to_torch(t)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x[:, :, ::2])


def test_vendored_messages_live_in_a_private_pool():
    from pagedattn._vendor.google.rpc import error_details_pb2, status_pb2
    from pagedattn._vendor.grpc.health.v1 import health_pb2

    for module in (status_pb2, error_details_pb2, health_pb2):
        assert module.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert status_pb2.Status.DESCRIPTOR.full_name == "google.rpc.Status"
    # So the standard modules load beside them (googleapis-common-protos and
    # grpcio-health-checking register the same full names in the default pool).
    theirs_status = pytest.importorskip("google.rpc.status_pb2")
    theirs_health = pytest.importorskip("grpc_health.v1.health_pb2")
    wire = status_pb2.Status(code=3, message="m").SerializeToString()
    assert theirs_status.Status.FromString(wire).message == "m"
    assert theirs_health.HealthCheckResponse.SERVING == health_pb2.HealthCheckResponse.SERVING


def test_the_package_needs_no_googleapis_common_protos():
    # pagedattn.v1's StepResponse.error is a google.rpc.Status: the vendored one, in the same
    # private pool, so the package imports where google.rpc (googleapis-common-protos) is absent.
    from pagedattn._vendor.google.rpc import status_pb2

    assert pb.StepResponse.DESCRIPTOR.file.pool is not descriptor_pool.Default()
    assert isinstance(pb.StepResponse().error, status_pb2.Status)
    code = (
        "import sys\n"
        "sys.modules['google.rpc'] = None\n"  # any import of google.rpc now fails
        "import pagedattn\n"
        "r = pagedattn.pb.StepResponse(layer=2)\n"
        "r.error.code = 5\n"
        "print(pagedattn.pb.StepResponse.FromString(r.SerializeToString()).error.code)\n"
    )
    root = str(Path(pagedattn.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5"
