#!/usr/bin/env python3
"""Merges the pagedattn-bench JSON files of one directory into one file of rows, each tagged
with its file's name as "variant", and prints a line per row.

  python3 kernels/bench/merge_rows.py DIR OUT.json
"""
import json
import os
import sys


def err_text(err):
    """max_rel_err as printed; null (an --exp variant's NaN or infinite error) as "none"."""
    return "none" if err is None else "%.2g" % err


def main():
    src, out = sys.argv[1], sys.argv[2]
    rows = []
    for name in sorted(os.listdir(src)):
        if not name.endswith(".json"):
            continue
        for r in json.load(open(os.path.join(src, name))):
            r["variant"] = name[:-5]
            rows.append(r)
    json.dump(rows, open(out, "w"), indent=1)
    for r in rows:
        value = r.get("tflops", r.get("tbps"))
        print(r["variant"], r["batch"], r.get("seqlen", r.get("ctx")), r.get("head_dim"),
              r.get("kernel", ""), value, "b2b_us=%.1f" % r.get("b2b_time_us", 0),
              "err=" + err_text(r.get("max_rel_err", 0)), r.get("read_tbps", ""))


if __name__ == "__main__":
    main()
