#!/usr/bin/env python3
"""Joins pagedattn-bench rows with peers.py rows from the same device call into a Markdown table.

  python3 kernels/bench/compare.py ours.json peers.json [more ours*.json ...]

Each decode shape (batch, ctx, heads, head_dim, dtype) gets one line: pagedattn's time and
TB/s, each peer's TB/s, pagedattn's ratio to cudnn, and its fraction of the HBM read limit that
peers.py measured in the same call (read_tbps). Prefill rows (suite prefill) get a second table:
TFLOP/s of pagedattn and of each peer on the same shape, and pagedattn's ratio to flash and flex.
"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def prefill_table(ours, peers):
    rows = [r for r in ours if r.get("suite") == "prefill"]
    if not rows:
        return
    key = lambda r: (r["batch"], r["seqlen"], r["q_heads"], r["kv_heads"], r["head_dim"], r["dtype"])
    by_shape = {}
    for r in peers:
        if r.get("suite") == "prefill" and "tflops" in r:
            by_shape.setdefault(key(r), {})[r["peer"]] = r
    print()
    print("| variant | batch x seqlen | head_dim | page | dtype | kernel | pagedattn TFLOP/s "
          "| flash | flex | cudnn | vs flash | vs flex |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = by_shape.get(key(r), {})
        tf = lambda name: f"{p[name]['tflops']:.1f}" if name in p else "-"
        vs = lambda name: f"{r['tflops'] / p[name]['tflops']:.2f}x" if name in p else "-"
        print(f"| {r.get('variant', '')} | {r['batch']} x {r['seqlen']} | {r['head_dim']} "
              f"| {r.get('page_size', '-')} | {r['dtype']} | {r.get('kernel', '')} | {r['tflops']:.1f} "
              f"| {tf('flash')} | {tf('flex')} | {tf('cudnn')} | {vs('flash')} | {vs('flex')} |")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    ours = load(sys.argv[1])
    peers = load(sys.argv[2])
    for extra in sys.argv[3:]:
        ours += load(extra)
    limits = {r["name"]: r["value"] for r in peers if r.get("suite") == "limit"}
    read = limits.get("read_tbps")
    key = lambda r: (r["batch"], r["ctx"], r["q_heads"], r["kv_heads"], r["head_dim"], r["dtype"])
    by_shape = {}
    for r in peers:
        if r.get("suite") == "decode" and "tbps" in r:
            by_shape.setdefault(key(r), {})[r["peer"]] = r
    print("| batch x ctx | q/kv heads | head_dim | page | dtype | pagedattn us | pagedattn TB/s "
          "| cudnn TB/s | flash TB/s | gather_flash TB/s | vs cudnn | of HBM read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in (r for r in ours if r.get("suite", "decode") == "decode"):
        p = by_shape.get(key(r), {})
        tb = lambda name: f"{p[name]['tbps']:.2f}" if name in p else "-"
        ratio = f"{p['cudnn']['time_us'] / r['time_us']:.2f}x" if "cudnn" in p else "-"
        frac = f"{r['tbps'] / read:.0%}" if read else "-"
        print(f"| {r['batch']} x {r['ctx']} | {r['q_heads']}/{r['kv_heads']} | {r['head_dim']} "
              f"| {r['page_size']} | {r['dtype']} | {r['time_us']:.1f} "
              f"| {r['tbps']:.2f} | {tb('cudnn')} | {tb('flash')} | {tb('gather_flash')} | {ratio} | {frac} |")
    prefill_table(ours, peers)
    if limits:
        print()
        print("Limits measured by peers.py in the same call: " +
              ", ".join(f"{k} {v:.2f}" for k, v in limits.items()))


if __name__ == "__main__":
    main()
