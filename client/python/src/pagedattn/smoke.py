"""The smoke check behind `python -m pagedattn smoke` (the twin of `pagedattn-cli smoke`): a
mixed prefill / decode / chunked prefill / attend-only / rewind batch of random data through a
real server, every span checked against the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .client import Client
from .reference import reference_attention, relative_error
from .tensors import (
    BFLOAT16, FLOAT16, FLOAT32, FLOAT8_E4M3, DTypeLike, dtype_enum, dtype_name, round_to_bfloat16,
)
from .types import CacheConfig, LayerAttention, Span

# (layer, spans): prefills, a decode, a chunked prefill, an attend-only span, a rewind.
STEPS = [
    (0, [Span(1, 0, 37, 37), Span(2, 0, 19, 19)]),
    (0, [Span(1, 37, 1, 1), Span(2, 19, 13, 13), Span(3, 0, 5, 5)]),
    (1, [Span(1, 0, 38, 38), Span(3, 0, 5, 2)]),
    (0, [Span(1, 30, 3, 3), Span(2, 0, 0, 0), Span(3, 5, 0, 4)]),
]
# The longest sequence the steps make: a window at least this long hides no position.
LONGEST_SEQUENCE = max(s.start + s.num_new_tokens for _, spans in STEPS for s in spans)
# An FP8 cache is checked against the unquantized K/V, within its documented bound (README, FP8
# caches), as pagedattn-cli smoke does.
TOLERANCE = {FLOAT32: 1e-5, FLOAT16: 2e-3, BFLOAT16: 1e-2, FLOAT8_E4M3: 0.15}


@dataclass
class SmokeReport:
    passed: bool = False
    max_rel_error: float = 0.0  # worst ||out-ref||/||ref|| over the spans checked
    max_lse_error: float = 0.0  # worst |lse-ref| over all queries and heads
    tolerance: float = 0.0
    forwards: int = 0
    spans_checked: int = 0
    cache_id: str = ""
    lines: list[str] = field(default_factory=list)  # one per Forward


def round_to(dtype: int, x: np.ndarray) -> np.ndarray:
    """float32 values rounded to `dtype`, as float32."""
    if dtype == FLOAT16:
        return x.astype(np.float16).astype(np.float32)
    if dtype == BFLOAT16:
        return round_to_bfloat16(x)
    return x.astype(np.float32)


def run_smoke(
    client: Client,
    *,
    head_dim: int = 128,
    page_size: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    kv_dtype: DTypeLike = "bfloat16",
    q_dtype: DTypeLike = "float32",
    seed: int = 1,
    kv_scaling: Optional[str] = None,
    kv_scales: Sequence[float] = (),
    device: int = 0,
    layers: Sequence[LayerAttention] = (),
) -> SmokeReport:
    """Creates a cache, runs the STEPS, checks every output and LSE, releases, deletes.
    RPC failures raise; a wrong answer is a report with passed=False. kv_scaling and kv_scales
    as CacheConfig's (a per-layer list: the cache's two layers take its first 4 values); the
    K/V are standard normal, which STATIC scales near 4.5 / 448 = 0.01 fit. device: the GPU
    the cache lives on. layers: the two layers' variants (one entry for both, or two), checked
    against the reference as plain attention is."""
    kv_t, q_t = dtype_enum(kv_dtype), dtype_enum(q_dtype)
    if kv_t not in TOLERANCE:
        raise ValueError("kv_dtype must be float32, float16, bfloat16 or float8_e4m3 "
                         f"(got {dtype_name(kv_t)})")
    if q_t not in (FLOAT32, FLOAT16, BFLOAT16):
        raise ValueError(f"q_dtype must be float32, float16 or bfloat16 (got {dtype_name(q_t)})")
    layers = tuple(layers)
    if len(layers) > 2:
        raise ValueError("the smoke cache has 2 layers: give its variants (layers) 1 entry for "
                         f"both or 2, not {len(layers)}")
    # The output comes back in q's dtype: its rounding counts too.
    report = SmokeReport(tolerance=max(TOLERANCE[kv_t], TOLERANCE[q_t]))
    # Room for the steps' three sequences of up to 64 tokens at any page size (page_size 1
    # needs 80 pages; 64 left it out of pages).
    num_pages = max(64, 3 * -(-64 // max(page_size, 1)))
    config = CacheConfig(2, num_q_heads, num_kv_heads, head_dim, page_size, kv_t,
                         num_pages=num_pages, kv_scaling=kv_scaling,
                         kv_scales=tuple(kv_scales)[:4], device=device, layers=layers)
    # Each layer's variant, for the reference and the report.
    variants = [layers[0 if len(layers) == 1 else i] if layers else LayerAttention() for i in (0, 1)]
    if layers:
        for i, l in enumerate(variants):
            parts = []
            if l.sliding_window:
                parts.append(f"window {l.sliding_window}" + (
                    f" (past the smoke's {LONGEST_SEQUENCE} positions: every one visible)"
                    if l.sliding_window >= LONGEST_SEQUENCE else ""))
            if l.logit_softcap:
                parts.append(f"soft-cap {l.logit_softcap:g}")
            if l.sinks:
                parts.append(f"{len(l.sinks)} sinks")
            report.lines.append(f"  layer {i}: " + (", ".join(parts) or "plain"))
    rng = np.random.default_rng(seed)
    # Host copy of each (layer, sequence)'s K and V rows, rounded to kv_dtype.
    kv: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    with client.create_cache(config, "python smoke") as cache:
        report.cache_id = cache.cache_id
        for layer, spans in STEPS:
            qs, ks, vs = [], [], []
            for s in spans:
                kh, vh = kv.get((layer, s.seq_id), (np.zeros((0, num_kv_heads, head_dim), np.float32),) * 2)
                if s.num_new_tokens > 0:
                    shape = (s.num_new_tokens, num_kv_heads, head_dim)
                    k_new = round_to(kv_t, rng.standard_normal(shape, dtype=np.float32))
                    v_new = round_to(kv_t, rng.standard_normal(shape, dtype=np.float32))
                    kh = np.concatenate([kh[: s.start], k_new])  # a rewind drops the tail
                    vh = np.concatenate([vh[: s.start], v_new])
                    ks.append(k_new)
                    vs.append(v_new)
                kv[(layer, s.seq_id)] = (kh, vh)
                qs.append(round_to(q_t, rng.standard_normal((s.num_queries, num_q_heads, head_dim), dtype=np.float32)))
            q = np.concatenate(qs)
            k = np.concatenate(ks) if ks else None
            v = np.concatenate(vs) if vs else None
            out, lse = cache.forward(layer, spans, q.astype(np.float32), k, v, return_lse=True,
                                     dtype=None if q_t == FLOAT32 else q_t)
            report.forwards += 1
            out = np.asarray(out, dtype=np.float64)
            step_err, row = 0.0, 0
            for s, qi in zip(spans, qs):
                if s.num_queries == 0:
                    continue
                kh, vh = kv[(layer, s.seq_id)]
                l = variants[layer]
                ref, ref_lse = reference_attention(qi, kh, vh, sliding_window=l.sliding_window,
                                                   logit_softcap=l.logit_softcap, sinks=l.sinks)
                step_err = max(step_err, relative_error(out[row : row + s.num_queries], ref))
                lse_err = np.abs(np.asarray(lse[row : row + s.num_queries], np.float64) - ref_lse)
                report.max_lse_error = max(report.max_lse_error, float(np.nan_to_num(lse_err, nan=np.inf).max()))
                report.spans_checked += 1
                row += s.num_queries
            report.max_rel_error = max(report.max_rel_error, step_err)
            report.lines.append(
                f"  forward layer {layer}, {len(spans)} spans, {q.shape[0]} queries: rel err {step_err:.3g}"
            )
        rel = cache.release([1, 2, 3])
        stats = cache.stats()
        released_all = stats.used_pages == 0 and stats.live_sequences == 0 and rel.released == 3
        if not released_all:
            report.lines.append("  release left pages in use")
    report.passed = (
        released_all
        and report.max_rel_error <= report.tolerance
        and report.max_lse_error <= 10 * report.tolerance
    )
    return report
