#!/usr/bin/env python3
"""Peer baselines for paged attention on the GPU machine, one JSON row per case:
torch SDPA (cuDNN, FlashAttention-2), flex_attention, a gather-then-SDPA paged path, and
FlashInfer (when importable).

Runs in the GPU machine's own python3 (PyTorch is there). Measures the
machine's limits and what a user could pick instead of this project, on the
same shapes the project's benchmark uses, so the two can be compared as a
ratio from one run:

  limit   copy_tbps, read_tbps (HBM), gemm_bf16_tflops
  decode  cudnn / flash : torch SDPA on contiguous (unpaged) KV -- the ideal
          gather_flash  : gather pages into contiguous KV, then SDPA flash --
                          what a torch user does with a paged cache
          flashinfer    : BatchDecodeWithPagedKVCacheWrapper on the paged cache
                          (pages in random order, NHD); "variant" says fa2
                          (CUDA-core decode kernel) or fa2_tc (use_tensor_cores)
  prefill cudnn / flash / flex : torch SDPA and flex_attention, causal
          flashinfer    : BatchPrefillWithPagedKVCacheWrapper on the paged cache,
                          "variant" fa2 or fa3 (the backend)

A layer attention variant (--window W, --softcap C, as pagedattn-bench's) goes to every peer
that has it: FlashInfer (window_left = W - 1, logits_soft_cap), flex_attention (a window mask,
a tanh score_mod), SDPA decode with a window (the last W positions, what a torch user slices);
SDPA has no soft-cap and its fused kernels no window mask in prefill, so those rows say so.
Rows carry "window" / "softcap" then, which compare.py joins on.

--kv-dtype float8_e4m3: FlashInfer's decode on an FP8 (E4M3) paged cache, K and V each
quantized with one scale (amax / 448, what FlashInfer takes: k_scale, v_scale); q and out stay
--dtype. Its rows carry "kv_dtype": "float8_e4m3" and count K/V bytes at one byte each; the
SDPA peers read no FP8 cache, so they are not run.

Shapes are "B,C" for decode (batch, context) and "B,L" for prefill (batch,
sequence length); heads and head_dim are flags. --ragged "C1,C2,..." adds one
decode batch of those contexts (flashinfer only: the SDPA peers need equal
lengths). Times are medians of CUDA event timings after warm-up; bandwidth
counts K and V bytes read once (the positions held, not whole pages),
throughput counts 4*B*Hq*L*L*D (halved when causal) FLOPs. FlashInfer rows also
carry max_rel_err: its output against a float32 reference on two sequences
(decode) or three query positions of the first sequence (prefill).

FlashInfer is imported only when a flashinfer row is asked for; its kernels
are compiled (JIT, nvcc) on first use and cached under FLASHINFER_WORKSPACE_BASE.

  python3 peers.py --out peers.json
  python3 peers.py --peers flashinfer --no-limits --out fi.json
  python3 peers.py --decode 64,4096 --prefill none --q-heads 64 --kv-heads 8
"""
import argparse, json, math, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

DEFAULT_DECODE = "1,32768 16,4096 64,4096 256,2048 128,8192"
DEFAULT_PREFILL = "4,4096 2,8192 1,16384"
ALL_PEERS = ("cudnn", "flash", "gather_flash", "flex", "flashinfer")
PEERS = set(ALL_PEERS)  # --peers narrows it
FI_DECODE_VARIANTS = ("fa2", "fa2_tc")
FI_PREFILL_VARIANTS = ("fa2", "fa3")
WINDOW = 0     # --window: a query at p sees p - WINDOW + 1 .. p (0: no window)
KV_FP8 = False  # --kv-dtype float8_e4m3: FlashInfer decode on an FP8 cache
SOFTCAP = 0.0  # --softcap: scores s become SOFTCAP * tanh(s / SOFTCAP) (0: none)


def variant_keys():
    """The row keys of the variant in force (none when plain)."""
    return {"window": WINDOW, "softcap": SOFTCAP} if WINDOW or SOFTCAP else {}


def fi_variant():
    """FlashInfer plan() keywords for the variant in force."""
    kw = {}
    if WINDOW:
        kw["window_left"] = WINDOW - 1
    if SOFTCAP:
        kw["logits_soft_cap"] = SOFTCAP
    return kw


def median_seconds(fn, warm=5, rep=25):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def limits(rows):
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
    t = median_seconds(lambda: y.copy_(x))
    rows.append({"suite": "limit", "name": "copy_tbps", "value": 2 * x.numel() / t / 1e12})
    del y
    f = x.view(torch.float32)
    t = median_seconds(lambda: torch.sum(f))
    rows.append({"suite": "limit", "name": "read_tbps", "value": x.numel() / t / 1e12})
    del x, f
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    t = median_seconds(lambda: a @ b)
    rows.append({"suite": "limit", "name": "gemm_bf16_tflops", "value": 2 * 8192 ** 3 / t / 1e12})


def decode(rows, shapes, hq, hk, d, page, dtype):
    for b, c in shapes:
        base = {"suite": "decode", "batch": b, "ctx": c, "q_heads": hq, "kv_heads": hk,
                "head_dim": d, "page_size": page, "dtype": str(dtype).split(".")[-1],
                **variant_keys()}
        if PEERS & {"cudnn", "flash", "gather_flash"} and not KV_FP8:
            sdpa_decode(rows, base, b, c, hq, hk, d, page, dtype)
        if "flashinfer" in PEERS:
            flashinfer_decode(rows, base, [c] * b, hq, hk, d, page, dtype)


def sdpa_decode(rows, base, b, c, hq, hk, d, page, dtype):
    if SOFTCAP:
        for peer in ("cudnn", "flash", "gather_flash"):
            if peer in PEERS:
                rows.append(dict(base, peer=peer, error="SDPA has no logit soft-cap"))
        return
    c = min(c, WINDOW) if WINDOW else c  # a window: the last WINDOW positions, sliced
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hk, c, d, device="cuda", dtype=dtype); v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()
    cases = {
        "cudnn": (SDPBackend.CUDNN_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "flash": (SDPBackend.FLASH_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
    }
    # a paged cache: pages in random order, a block table per sequence (whole pages only)
    if "gather_flash" in PEERS and c % page == 0:
        n = b * c // page
        kp = k.permute(0, 2, 1, 3).reshape(n, page, hk, d); vp = v.permute(0, 2, 1, 3).reshape(n, page, hk, d)
        perm = torch.randperm(n, device="cuda"); kp = kp[perm].contiguous(); vp = vp[perm].contiguous()
        table = torch.argsort(perm).view(b, c // page)

        def gather_flash():
            kk = kp[table].reshape(b, c, hk, d).transpose(1, 2)
            vv = vp[table].reshape(b, c, hk, d).transpose(1, 2)
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
        cases["gather_flash"] = (SDPBackend.FLASH_ATTENTION, gather_flash)
    for peer, (backend, fn) in cases.items():
        if peer not in PEERS:
            continue
        row = dict(base, peer=peer)
        try:
            with sdpa_kernel(backend):
                t = median_seconds(fn)
            row.update(time_us=t * 1e6, tbps=kv_bytes / t / 1e12)
        except Exception as ex:  # a backend that refuses the shape
            row["error"] = str(ex)[:160]
        rows.append(row)
    del q, k, v
    torch.cuda.empty_cache()


_FI_WORKSPACE = None


def _fi_workspace():
    global _FI_WORKSPACE
    if _FI_WORKSPACE is None:
        _FI_WORKSPACE = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    return _FI_WORKSPACE


def _fi_paged_cache(ctxs, hk, d, page, dtype):
    """A paged cache holding len(ctxs) sequences, pages in random order (NHD layout)."""
    pages = [(c + page - 1) // page for c in ctxs]
    n = sum(pages)
    kc = torch.randn(n, page, hk, d, device="cuda", dtype=dtype); vc = torch.randn_like(kc)
    indices = torch.randperm(n, device="cuda").to(torch.int32)
    indptr = torch.tensor([0] + list(_cumsum(pages)), device="cuda", dtype=torch.int32)
    last = torch.tensor([c - (p - 1) * page for c, p in zip(ctxs, pages)], device="cuda", dtype=torch.int32)
    return kc, vc, indptr, indices, last


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _seq_kv(kc, vc, indptr, indices, s, ctx):
    """K and V of sequence s as [ctx, hk, d] float32 (gathered through its pages)."""
    idx = indices[indptr[s]:indptr[s + 1]].long()
    k = kc[idx].reshape(-1, kc.shape[2], kc.shape[3])[:ctx].float()
    v = vc[idx].reshape(-1, vc.shape[2], vc.shape[3])[:ctx].float()
    return k, v


def _ref_attend(q, k, v):
    """q [hq, d], the query at position n - 1, attends k, v [n, hk, d] (GQA, groups of hq/hk
    consecutive heads) under the variant in force: [hq, d]."""
    if WINDOW:
        k, v = k[-WINDOW:], v[-WINDOW:]
    hq, d = q.shape
    hk = k.shape[1]
    qg = q.float().view(hk, hq // hk, d)
    s = torch.einsum("kgd,nkd->kgn", qg, k) / math.sqrt(d)
    if SOFTCAP:
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("kgn,nkd->kgd", p, v).reshape(hq, d)


def _rel_err(got, ref):
    got = got.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return (torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref)).item()


def flashinfer_decode(rows, base, ctxs, hq, hk, d, page, dtype):
    """FlashInfer's paged decode over sequences of the given context lengths."""
    b = len(ctxs)
    try:
        import flashinfer
        kc, vc, indptr, indices, last = _fi_paged_cache(ctxs, hk, d, page, dtype)
        q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
    except Exception as ex:
        rows.append(dict(base, peer="flashinfer", error=f"{type(ex).__name__}: {ex}"[:300]))
        return
    scales = {}
    kv_dtype = dtype
    if KV_FP8:  # one scale for K and one for V: the values' amax / 448
        kv_dtype = torch.float8_e4m3fn
        ks, vs = (kc.abs().max() / 448).item(), (vc.abs().max() / 448).item()
        kc, vc = (kc / ks).to(kv_dtype), (vc / vs).to(kv_dtype)
        scales = dict(k_scale=ks, v_scale=vs)
        base = dict(base, kv_dtype="float8_e4m3")
    read = [min(c, WINDOW) if WINDOW else c for c in ctxs]  # a window's positions only
    kv_bytes = 2 * sum(read) * hk * d * kc.element_size()
    for variant in FI_DECODE_VARIANTS:
        row = dict(base, peer="flashinfer", variant=variant)
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _fi_workspace(), "NHD", use_tensor_cores=(variant == "fa2_tc"))
            w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=dtype,
                   kv_data_type=kv_dtype, **fi_variant())
            out = w.run(q, (kc, vc), **scales)
            torch.cuda.synchronize()
            err = 0.0
            for s in sorted({0, b - 1}):
                k, v = _seq_kv(kc, vc, indptr, indices, s, ctxs[s])
                if KV_FP8:
                    k, v = k * scales["k_scale"], v * scales["v_scale"]
                err = max(err, _rel_err(out[s], _ref_attend(q[s], k, v)))
            t = median_seconds(lambda: w.run(q, (kc, vc), **scales))
            row.update(time_us=t * 1e6, tbps=kv_bytes / t / 1e12, max_rel_err=err,
                       resolved_backend=str(getattr(w, "resolved_backend", "")))
        except Exception as ex:
            row["error"] = f"{type(ex).__name__}: {ex}"[:300]
        rows.append(row)
    del kc, vc, q
    torch.cuda.empty_cache()


def flashinfer_prefill(rows, base, b, l, hq, hk, d, page, dtype, causal):
    try:
        import flashinfer
        kc, vc, kv_indptr, indices, last = _fi_paged_cache([l] * b, hk, d, page, dtype)
        q = torch.randn(b * l, hq, d, device="cuda", dtype=dtype)
        qo_indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * l
    except Exception as ex:
        rows.append(dict(base, peer="flashinfer", error=f"{type(ex).__name__}: {ex}"[:300]))
        return
    flops = 4 * b * hq * l * l * d * (0.5 if causal else 1.0)
    for variant in FI_PREFILL_VARIANTS:
        row = dict(base, peer="flashinfer", variant=variant, page_size=page)
        try:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_fi_workspace(), "NHD", backend=variant)
            w.plan(qo_indptr, kv_indptr, indices, last, hq, hk, d, page, causal=causal,
                   q_data_type=dtype, kv_data_type=dtype, **fi_variant())
            out = w.run(q, (kc, vc))
            torch.cuda.synchronize()
            k, v = _seq_kv(kc, vc, kv_indptr, indices, 0, l)
            err = 0.0
            for pos in (0, l // 2 + 17, l - 1):
                n = pos + 1 if causal else l  # (a window under non-causal: not checked here)
                err = max(err, _rel_err(out[pos], _ref_attend(q[pos], k[:n], v[:n])))
            t = median_seconds(lambda: w.run(q, (kc, vc)))
            row.update(time_us=t * 1e6, tflops=flops / t / 1e12, max_rel_err=err,
                       resolved_backend=str(getattr(w, "_backend", "")))
        except Exception as ex:
            row["error"] = f"{type(ex).__name__}: {ex}"[:300]
        rows.append(row)
    del kc, vc, q
    torch.cuda.empty_cache()


_FLEX = None


def _flex():
    global _FLEX
    if _FLEX is None:
        try:
            from torch.nn.attention.flex_attention import flex_attention, create_block_mask
            _FLEX = (torch.compile(flex_attention), create_block_mask)
        except Exception:
            _FLEX = (None, None)
    return _FLEX


def prefill(rows, shapes, hq, hk, d, dtype, page=16, causal=True):
    flex, create_block_mask = _flex() if "flex" in PEERS else (None, None)
    for b, l in shapes:
        base = {"suite": "prefill", "batch": b, "seqlen": l, "q_heads": hq, "kv_heads": hk,
                "head_dim": d, "causal": causal, "dtype": str(dtype).split(".")[-1],
                **variant_keys()}
        flops = 4 * b * hq * l * l * d * (0.5 if causal else 1.0)
        if PEERS & {"cudnn", "flash", "flex"}:
            q = torch.randn(b, hq, l, d, device="cuda", dtype=dtype)
            k = torch.randn(b, hk, l, d, device="cuda", dtype=dtype); v = torch.randn_like(k)
            cases = {} if WINDOW or SOFTCAP else {
                "cudnn": (SDPBackend.CUDNN_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)),
                "flash": (SDPBackend.FLASH_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)),
            }
            for peer in ("cudnn", "flash"):
                if (WINDOW or SOFTCAP) and peer in PEERS:
                    rows.append(dict(base, peer=peer, error="SDPA's fused kernels have no window "
                                     "mask or logit soft-cap"))
            if flex is not None:
                def visible(bb, h, qi, ki):
                    seen = qi >= ki if causal else qi >= 0
                    return (seen & (qi - ki < WINDOW)) if WINDOW else seen
                mask = create_block_mask(visible, None, None, l, l) if causal or WINDOW else None
                score_mod = None
                if SOFTCAP:
                    def score_mod(score, bb, h, qi, ki):
                        return SOFTCAP * torch.tanh(score / SOFTCAP)
                cases["flex"] = (None, lambda: flex(q, k, v, score_mod=score_mod, block_mask=mask,
                                                    enable_gqa=True))
            for peer, (backend, fn) in cases.items():
                if peer not in PEERS:
                    continue
                row = dict(base, peer=peer)
                try:
                    if backend is None:
                        t = median_seconds(fn)
                    else:
                        with sdpa_kernel(backend):
                            t = median_seconds(fn)
                    row.update(time_us=t * 1e6, tflops=flops / t / 1e12)
                except Exception as ex:
                    row["error"] = str(ex)[:160]
                rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
        if "flashinfer" in PEERS:
            flashinfer_prefill(rows, base, b, l, hq, hk, d, page, dtype, causal)


def parse_shapes(text):
    if text in ("", "none"):
        return []
    return [tuple(int(x) for x in s.split(",")) for s in text.split()]


def main():
    global PEERS, WINDOW, SOFTCAP, KV_FP8
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", default=DEFAULT_DECODE, help='"B,C B,C ..." or none')
    p.add_argument("--prefill", default=DEFAULT_PREFILL, help='"B,L B,L ..." or none')
    p.add_argument("--ragged", default="", help='"C1,C2,..." one decode batch of these contexts (flashinfer)')
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--kv-dtype", choices=["same", "float8_e4m3"], default="same",
                   help="the paged cache's dtype for FlashInfer decode (same: --dtype)")
    p.add_argument("--non-causal", action="store_true", help="prefill without the causal mask")
    p.add_argument("--window", type=int, default=0, help="sliding window W (0: none)")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-cap C (0: none)")
    p.add_argument("--peers", default=",".join(ALL_PEERS), help="comma list of " + ",".join(ALL_PEERS))
    p.add_argument("--no-limits", action="store_true")
    p.add_argument("--out", help="write the rows here as a JSON list")
    a = p.parse_args()
    PEERS = set(x for x in a.peers.split(",") if x)
    WINDOW, SOFTCAP = a.window, a.softcap
    KV_FP8 = a.kv_dtype == "float8_e4m3"
    dtype = getattr(torch, a.dtype)
    rows = []
    if not a.no_limits:
        limits(rows)
    decode(rows, parse_shapes(a.decode), a.q_heads, a.kv_heads, a.head_dim, a.page_size, dtype)
    if a.ragged and "flashinfer" in PEERS:
        ctxs = [int(x) for x in a.ragged.split(",") if x]
        base = {"suite": "decode", "batch": len(ctxs), "ctx": "ragged", "ctxs": ctxs,
                "q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                "page_size": a.page_size, "dtype": a.dtype, **variant_keys()}
        flashinfer_decode(rows, base, ctxs, a.q_heads, a.kv_heads, a.head_dim, a.page_size, dtype)
    prefill(rows, parse_shapes(a.prefill), a.q_heads, a.kv_heads, a.head_dim, dtype,
            page=a.page_size, causal=not a.non_causal)
    for r in rows:
        print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
