#!/usr/bin/env bash
# One GPU-machine call that checks a decode change end to end (run from the repository root,
# the stage in .stage, carry [".stage"]): the tests (run_tests.sh); the default decode shapes
# with their read roofline and peers.py's decode rows; three alternating rounds at 1 x 32768 of
# the planned split-KV merge against the tile kernel's own (--merge in-kernel); then
# run_beyond_defaults.sh into OUT/beyond. Prints the comparison tables.
#
#   there:  bash kernels/bench/run_decode_check.sh
set -uo pipefail
here=$(dirname "$0")
source "$here/lib.sh" .stage "$OUT"
bash "$here/run_tests.sh" "$stage" "$out"
bench decode "$b/pagedattn-bench"
timeout 200 python3 "$stage/peers.py" --prefill none --out "$out/peers_decode.json" > "$out/peers.log" 2>&1; echo "peers rc=$?"
for r in 1 2 3; do
  for m in planned in-kernel; do
    bench "merge/${m}_r$r" "$b/pagedattn-bench" --cases "1,32768" --merge $m --no-read-roofline
  done
done
python3 "$here/merge_rows.py" "$tmp/merge" "$out/merge_ab.json" > /dev/null
python3 "$here/rounds.py" "$out/merge_ab.json"
mkdir -p "$out/beyond"; bash "$here/run_beyond_defaults.sh" "$stage" "$out/beyond" 2>&1 | tail -40
python3 "$here/merge_rows.py" "$tmp" "$out/decode.json" > /dev/null
python3 "$here/compare.py" "$out/decode.json" "$out/peers_decode.json" 2>&1 | grep -E "^\| [0-9]|Limits"
