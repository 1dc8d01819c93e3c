#!/usr/bin/env python3
"""Prints an A/B's rounds side by side: one line per (page size, q heads, kv heads, head_dim,
batch, ctx, variant), where the variant is the bench run's name without its round suffix
("new_r2" -> "new"), listing each round's per-launch / back-to-back microseconds and the worst
max_rel_err. Input: the file merge_rows.py wrote.

  python3 kernels/bench/rounds.py OUT/ab.json
"""
import collections
import json
import re
import sys


def main():
    with open(sys.argv[1]) as f:
        rows = json.load(f)
    groups = collections.defaultdict(list)
    for r in rows:
        variant = re.sub(r"_r\d+$", "", r.get("variant", ""))
        shape = (r.get("page_size"), r.get("q_heads"), r.get("kv_heads"), r.get("head_dim"),
                 r.get("batch"), r.get("ctx"))
        groups[shape + (variant,)].append(r)
    order = lambda k: tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in k)
    for key in sorted(groups, key=order):
        runs = groups[key]
        times = " ".join("%.2f/%.2f" % (r["time_us"], r["b2b_time_us"]) for r in runs)
        errs = [r["max_rel_err"] for r in runs if r.get("max_rel_err") is not None]
        page, hq, hkv, d, batch, ctx, variant = key
        print("page %s  %s/%s heads  d%s  %s x %s  %-12s %s  err %s" %
              (page, hq, hkv, d, batch, ctx, variant, times,
               "%.2g" % max(errs) if errs else "none"))


if __name__ == "__main__":
    main()
