#!/usr/bin/env python3
"""Joins pagedattn-bench rows with peers.py rows of the same run into Markdown tables.

  python3 kernels/bench/compare.py OURS PEERS

OURS and PEERS are each a JSON file of rows or a folder of them (run_suite.sh writes OUT/ours/
and OUT/peers/); a row without a "variant" takes its file's name. Each decode row gets a line:
pagedattn's time and TB/s, each peer's TB/s on the same shape (batch, ctx, heads, head_dim,
dtype), pagedattn's ratio to cudnn, and its fraction of the HBM read limit peers.py measured
(read_tbps), and its ratios to cudnn and to FlashInfer. Prefill rows get a second table: TFLOP/s
of pagedattn and of each peer on the same shape, and pagedattn's ratio to each. FlashInfer's rows
(one per variant: fa2, fa2_tc, fa3) count as its fastest on each shape.
"""
import json
import os
import sys


def load(path):
    """The rows of a JSON file, or of every JSON file in a folder (tagged with the file's name)."""
    if not os.path.isdir(path):
        with open(path) as f:
            return json.load(f)
    rows = []
    for name in sorted(os.listdir(path)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(path, name)) as f:
            for r in json.load(f):
                r.setdefault("variant", name[:-5])
                rows.append(r)
    return rows


def by_peer(peers, suite, metric, key):
    """shape -> peer -> row; of a peer's several variants, the fastest."""
    by_shape = {}
    for r in peers:
        if r.get("suite") != suite or metric not in r:
            continue
        slot = by_shape.setdefault(key(r), {})
        if r["peer"] not in slot or r["time_us"] < slot[r["peer"]]["time_us"]:
            slot[r["peer"]] = r
    return by_shape


def decode_table(ours, peers, read):
    key = lambda r: (r["batch"], r["ctx"], r["q_heads"], r["kv_heads"], r["head_dim"], r["dtype"],
                     r.get("window", 0), r.get("softcap", 0))
    by_shape = by_peer(peers, "decode", "tbps", key)
    print("| variant | batch x ctx | q/kv heads | head_dim | page | dtype | q | pagedattn us "
          "| pagedattn TB/s | cudnn TB/s | flash TB/s | flashinfer TB/s | gather_flash TB/s "
          "| vs cudnn | vs flashinfer | of HBM read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in (r for r in ours if r.get("suite", "decode") == "decode"):
        p = by_shape.get(key(r), {})
        tb = lambda name: f"{p[name]['tbps']:.2f}" if name in p else "-"
        vs = lambda name: f"{p[name]['time_us'] / r['time_us']:.2f}x" if name in p else "-"
        frac = f"{r['tbps'] / read:.0%}" if read else "-"
        print(f"| {r.get('variant', '')} | {r['batch']} x {r['ctx']} | {r['q_heads']}/{r['kv_heads']} "
              f"| {r['head_dim']} | {r['page_size']} | {r['dtype']} | {r.get('q_dtype', '-')} "
              f"| {r['time_us']:.1f} | {r['tbps']:.2f} | {tb('cudnn')} | {tb('flash')} "
              f"| {tb('flashinfer')} | {tb('gather_flash')} | {vs('cudnn')} | {vs('flashinfer')} "
              f"| {frac} |")


def prefill_table(ours, peers):
    rows = [r for r in ours if r.get("suite") == "prefill"]
    if not rows:
        return
    key = lambda r: (r["batch"], r["seqlen"], r["q_heads"], r["kv_heads"], r["head_dim"],
                     r["dtype"], r.get("causal", True), r.get("window", 0), r.get("softcap", 0))
    by_shape = by_peer(peers, "prefill", "tflops", key)
    print()
    print("| variant | batch x seqlen | head_dim | page | dtype | causal | kernel | pagedattn TFLOP/s "
          "| flash | flex | cudnn | flashinfer | vs flash | vs flex | vs cudnn | vs flashinfer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = by_shape.get(key(r), {})
        tf = lambda name: f"{p[name]['tflops']:.1f}" if name in p else "-"
        vs = lambda name: f"{r['tflops'] / p[name]['tflops']:.2f}x" if name in p else "-"
        print(f"| {r.get('variant', '')} | {r['batch']} x {r['seqlen']} | {r['head_dim']} "
              f"| {r.get('page_size', '-')} | {r['dtype']} | {r.get('causal', True)} "
              f"| {r.get('kernel', '')} | {r['tflops']:.1f} | {tf('flash')} | {tf('flex')} "
              f"| {tf('cudnn')} | {tf('flashinfer')} | {vs('flash')} | {vs('flex')} "
              f"| {vs('cudnn')} | {vs('flashinfer')} |")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ours = load(sys.argv[1])
    peers = load(sys.argv[2]) if os.path.exists(sys.argv[2]) else []
    limits = {r["name"]: r["value"] for r in peers if r.get("suite") == "limit"}
    decode_table(ours, peers, limits.get("read_tbps"))
    prefill_table(ours, peers)
    if limits:
        print()
        print("Limits measured by peers.py in the same run: " +
              ", ".join(f"{k} {v:.2f}" for k, v in limits.items()))


if __name__ == "__main__":
    main()
