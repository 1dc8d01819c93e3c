"""E4M3 against E5M2 for the FP8 cache: attention's error on quantized K/V.

Float64 attention over K/V rounded to each format (scaled as the cache scales: PER_TOKEN, each
row max|x| / the format's largest value; STATIC, one range of 4 sigma, x30 with outlier channels)
against the same attention on the unquantized K/V. Data as tests/fp8_sweep.h's: q and K/V of
unit spread, or K/V with every 16th channel 30x (outliers); sm_scale 1/sqrt(d). Prints, per
format, scaling and data, the output's relative error (||out - ref|| / ||ref|| of each query
row, worst and mean over rows) and the LSE's absolute error (worst), over spans of 1..4096.

  python3 fp8_formats.py [--seed N]    (numpy, ml_dtypes)
"""
import argparse
import ml_dtypes
import numpy as np

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def quantize(x, fmt, scaling, static_range):
    dtype, top = FORMATS[fmt]
    if scaling == "per_token":
        scale = np.abs(x).max(axis=-1, keepdims=True) / top
        scale[scale == 0] = 1.0
    else:
        scale = np.float64(static_range / top)
    q = np.clip(x / scale, -top, top).astype(np.float32).astype(dtype)
    return q.astype(np.float64) * scale


def attention(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return p @ v / l, (m + np.log(l))[:, 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    d = a.head_dim
    print(f"head_dim {d}, 8 query rows a span; out: ||out - ref|| / ||ref|| per row (worst, mean); lse: worst |error|")
    print(f"{'format':6} {'scaling':9} {'data':8} {'span':>5} {'out worst':>10} {'out mean':>9} {'lse worst':>10}")
    for outliers in (False, True):
        gain = np.ones(d)
        if outliers:
            gain[::16] = 30.0
        for n in (1, 5, 70, 4096):
            q = rng.standard_normal((8, d))
            k = rng.standard_normal((n, d)) * gain
            v = rng.standard_normal((n, d)) * gain
            ref, ref_lse = attention(q, k, v)
            for fmt in FORMATS:
                for scaling in ("per_token", "static"):
                    rng_static = 4.0 * (30.0 if outliers else 1.0)
                    out, lse = attention(q, quantize(k, fmt, scaling, rng_static),
                                         quantize(v, fmt, scaling, rng_static))
                    err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
                    print(f"{fmt:6} {scaling:9} {'outliers' if outliers else 'random':8} {n:5} "
                          f"{err.max():10.4f} {err.mean():9.4f} {np.abs(lse - ref_lse).max():10.4f}")


if __name__ == "__main__":
    main()
