"""The float64 numpy oracle: the attention one span of a Forward must produce, and the
relative error the smoke check and the tests compare with."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    logit_softcap: Optional[float] = None,
    sinks: Sequence[float] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of one sequence in float64.

    Args:
        q: [num_queries, num_q_heads, head_dim]; the queries sit at the last num_queries
            positions of the sequence.
        k, v: [kv_len, num_kv_heads, head_dim], the whole sequence (num_q_heads a multiple of
            num_kv_heads: GQA maps q head h to kv head h // (num_q_heads // num_kv_heads)).
        causal: query at position p attends positions <= p.
        sm_scale: softmax scale, default 1/sqrt(head_dim).
        sliding_window, logit_softcap, sinks: a layer's variant (LayerAttention's fields): the
            query at p sees p - sliding_window + 1 .. only; scores become
            cap * tanh(score / cap); one logit per q head joins each row's denominator.

    Returns:
        (out [num_queries, num_q_heads, head_dim] float64,
         lse [num_queries, num_q_heads] float64, the natural-log log-sum-exp of the scaled scores).
    """
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    nq, hq, d = q64.shape
    nk, hkv, _ = k64.shape
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if sm_scale is None else float(sm_scale)
    kh = np.repeat(k64, group, axis=1)  # [nk, hq, d]
    vh = np.repeat(v64, group, axis=1)
    # [hq, nq, nk] through BLAS matmuls (einsum without BLAS is slow for long prefills)
    scores = np.matmul(q64.transpose(1, 0, 2), kh.transpose(1, 2, 0)) * scale
    if logit_softcap:
        scores = logit_softcap * np.tanh(scores / logit_softcap)
    q_pos = np.arange(nk - nq, nk)[:, None]
    k_pos = np.arange(nk)[None, :]
    visible = np.ones((nq, nk), dtype=bool)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window:
        visible &= k_pos > q_pos - sliding_window
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)  # [hq, nq, 1]
    sink = np.asarray(sinks, dtype=np.float64).reshape(hq, 1, 1) if len(sinks) else None
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp(scores - m)
    s = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        s = s + np.exp(sink - m)
    out = np.matmul(p / s, vh.transpose(1, 0, 2)).transpose(1, 0, 2)  # [nq, hq, d]
    lse = (m + np.log(s))[..., 0].T  # [nq, hq]
    return out, lse


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64 (inf when got has a NaN)."""
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if np.isnan(g).any():
        return float("inf")
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(g - r) / (denom if denom > 0 else 1.0))
