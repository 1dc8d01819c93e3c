#!/usr/bin/env bash
# The GPU host's run of the kernel library: the GPU tests, compute-sanitizer's memcheck and
# racecheck, the bench over the default and beyond-the-default shapes, the peers on the same
# shapes, and the ratio table, every JSON row and log written into OUT_DIR.
#
#   kernels/bench/run_suite.sh BUILD_DIR OUT_DIR
#
# BUILD_DIR is a CUDA build (scripts/build.sh BUILD_DIR, or cmake + ninja): its binaries are
# taken where the build puts them (tests/, server/, client/, kernels/bench/); one that is missing
# is reported and left out. Set LD_LIBRARY_PATH beforehand if the binaries need libraries the
# host does not have. Environment knobs:
#   SKIP_TESTS=1     no tests and no compute-sanitizer
#   SANITIZER=0      no compute-sanitizer (memcheck and racecheck over cuda_backend_test run
#                    when compute-sanitizer is on PATH); SANITIZER_FILTER narrows their gtest
#                    filter (default: every test), SANITIZER_SHARDS their processes (default 5)
#   PEERS=0          no peers.py (FlashInfer rows only when `import flashinfer` works)
#   QUICK=1          the default decode and prefill shapes only, with fewer repetitions
#   FUZZ_CONFIGS=N   random cache configs config_fuzz_test runs on each backend, and ipc_test
#                    through device tensors (default 200)
#   BENCH_TIMEOUT=N  seconds per bench or peers run (default 300)
#   PROFILE_BUILD=DIR  a second build, configured with -DPAGEDATTN_PROFILE=ON: its bench also
#                    writes the phase timelines (--profile) of the default decode and prefill
#                    shapes, bf16 and FP8, into OUT_DIR/profile/ (the summaries in its logs)
#
# Outputs: OUT_DIR/logs/*.log (one per test, sanitizer, bench and peers run), OUT_DIR/ours/*.json
# (bench rows, one file per run, its name the row's "variant" in compare.py),
# OUT_DIR/peers/*.json (peers.py rows) and OUT_DIR/pipe_probe.json (pagedattn-pipe-probe's row).
# The last lines printed are compare.py's tables.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BUILD_DIR OUT_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd)
out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/logs" "$out/ours" "$out/peers"
out=$(cd "$out" && pwd)
timeout_s=${BENCH_TIMEOUT:-300}
bench_bin=$build/kernels/bench/pagedattn-bench
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>/dev/null

# test NAME TIMEOUT BINARY [ARGS...]: one test binary, its log to logs/NAME.log, a line of result.
test_run() {
  local name=$1 limit=$2 bin=$3
  shift 3
  if [ ! -x "$bin" ]; then
    echo "$name: not built ($bin)"
    return
  fi
  timeout "$limit" "$bin" "$@" > "$out/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/logs/$name.log" | tr '\n' ' ')"
}

# The server on a free port and `pagedattn-cli smoke` against it, then SIGTERM.
server_smoke() {
  local server=$build/server/pagedattn-server cli=$build/client/pagedattn-cli
  local log=$out/logs/server.log
  if [ ! -x "$server" ] || [ ! -x "$cli" ]; then
    echo "server smoke: not built"
    return
  fi
  "$server" --listen=127.0.0.1:0 --health_listen=127.0.0.1:0 > "$log" 2>&1 &
  local pid=$! port=""
  for _ in $(seq 200); do
    port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log" | head -1)
    { [ -n "$port" ] && grep -q "security: " "$log"; } && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  if [ -z "$port" ]; then
    echo "server smoke: the server did not start (logs/server.log)"
    kill "$pid" 2>/dev/null
    return
  fi
  timeout 120 "$cli" --target="127.0.0.1:$port" smoke > "$out/logs/cli_smoke.log" 2>&1
  echo "cli smoke rc=$? $(tail -1 "$out/logs/cli_smoke.log")"
  kill -TERM "$pid"
  wait "$pid"
  echo "server exit rc=$?"
}

# sanitize TOOL [FLAGS...]: cuda_backend_test under compute-sanitizer's TOOL, as
# SANITIZER_SHARDS gtest shards side by side (each a process of its own on the GPU: about 6
# minutes for the 29 tests in 5 shards on an H200), logs/TOOL_I.log, one line of result a shard.
sanitize() {
  local tool=$1 shards=${SANITIZER_SHARDS:-5} i
  local -a pids=()
  shift
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout 3600 compute-sanitizer \
      --tool "$tool" "$@" --error-exitcode 1 "$build/tests/cuda_backend_test" \
      --gtest_filter="${SANITIZER_FILTER:-*}" > "$out/logs/${tool}_$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < shards; ++i)); do
    wait "${pids[i]}"
    echo "$tool(cuda_backend_test shard $i) rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' \
      "$out/logs/${tool}_$i.log" | tr '\n' ' ')$(grep -E '(ERROR|RACECHECK) SUMMARY' \
      "$out/logs/${tool}_$i.log" | tail -1)"
  done
}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  t=$build/tests
  test_run attention_plan_test 120 "$t/attention_plan_test"
  test_run wgmma_layout_test 120 "$t/wgmma_layout_test"
  test_run cuda_backend_test 1200 "$t/cuda_backend_test"
  PAGEDATTN_PREFILL_KERNEL=portable test_run cuda_backend_test_portable_prefill 600 \
    "$t/cuda_backend_test" --gtest_filter='*Prefill*:*Mixed*:*Odd*:*OwnDtype*'
  PAGEDATTN_E2E_BACKEND=cuda test_run e2e_test_cuda 600 "$t/e2e_test"
  PAGEDATTN_E2E_BACKEND=cuda test_run data_plane_test_cuda 600 "$t/data_plane_test"
  PAGEDATTN_E2E_BACKEND=cuda test_run sharded_test_cuda 600 "$t/sharded_test"
  PAGEDATTN_SERVER_BIN=$build/server/pagedattn-server \
    PAGEDATTN_FUZZ_CONFIGS=${FUZZ_CONFIGS:-200} test_run ipc_test 900 "$t/ipc_test"
  test_run backend_parity_test 600 "$t/backend_parity_test"
  PAGEDATTN_FUZZ_CONFIGS=${FUZZ_CONFIGS:-200} test_run config_fuzz_test 900 "$t/config_fuzz_test"
  server_smoke
  if [ "${SANITIZER:-1}" != 0 ] && command -v compute-sanitizer > /dev/null; then
    sanitize memcheck
    sanitize racecheck --racecheck-report hazard
  fi
fi

# bench NAME [FLAGS...]: one pagedattn-bench run, its rows to ours/NAME.json.
bench() {
  local name=$1
  shift
  if [ ! -x "$bench_bin" ]; then
    echo "bench $name: not built ($bench_bin)"
    return
  fi
  timeout "$timeout_s" "$bench_bin" "$@" --json "$out/ours/$name.json" \
    > "$out/logs/bench_$name.log" 2>&1 || echo "bench $name failed rc=$? (logs/bench_$name.log)"
}

peers_flags=()
if ! python3 -c "import flashinfer" > /dev/null 2>&1; then
  peers_flags=(--peers cudnn,flash,gather_flash,flex)
fi
# peers NAME [FLAGS...]: one peers.py run, its rows to peers/NAME.json.
peers() {
  local name=$1
  shift
  [ "${PEERS:-1}" = 0 ] && return
  timeout "$timeout_s" python3 "$here/peers.py" ${peers_flags[@]+"${peers_flags[@]}"} "$@" \
    --out "$out/peers/$name.json" > "$out/logs/peers_$name.log" 2>&1 ||
    echo "peers $name failed rc=$? (logs/peers_$name.log)"
}

# both NAME SHAPES [FLAGS...]: decode shapes beyond the defaults, bench and peers alike.
both() {
  local name=$1 shapes=$2
  shift 2
  bench "$name" --cases "$shapes" --reps 30 "$@"
  peers "$name" --no-limits --prefill none --decode "$shapes" "$@"
}

if [ "${QUICK:-0}" = 1 ]; then
  bench decode --reps 20
  bench prefill --suite prefill --reps 10
  peers default
else
  # The default shapes (peers.py's), page sizes, the float32 wire path, both prefill kernels.
  bench decode
  bench decode_q_f32 --q-dtype float32
  bench decode_p64 --page-size 64
  bench decode_p128 --page-size 128
  bench decode_p1 --page-size 1 --cases "1,32768 16,4096"
  bench prefill --suite prefill
  bench prefill_portable --suite prefill --prefill-path portable
  bench prefill_p128 --suite prefill --page-size 128
  bench prefill_p1 --suite prefill --page-size 1 --cases "1,4096" --reps 10
  bench prefill_non_causal --suite prefill --non-causal --cases "4,4096" --reps 20
  peers default
  # Beyond the defaults: the other head dims, float16, GQA groups other than 4, few kv heads
  # (wide tiles, many splits, the separate merge), short and long contexts.
  defaults="1,32768 16,4096 64,4096 256,2048 128,8192"
  for d in 64 80 96 192 256; do
    both "d$d" "$defaults" --head-dim $d
  done
  both f16 "1,32768 256,2048" --dtype float16
  both gqa8 "1,32768 16,4096 64,4096" --q-heads 64 --kv-heads 8
  both mha "1,32768 16,4096 64,2048" --q-heads 32 --kv-heads 32
  both gqa7 "1,32768 16,4096 64,4096 128,8192" --q-heads 28 --kv-heads 4
  both gqa5 "1,32768 16,4096 64,4096" --q-heads 40 --kv-heads 8
  both gqa2 "1,32768 16,4096 64,4096" --q-heads 16 --kv-heads 8
  both kv1 "1,32768 8,4096 1,131072" --kv-heads 1
  both kv2 "1,32768 2,16384" --kv-heads 2
  both kv1_gqa8 "1,32768 16,4096 64,4096" --q-heads 8 --kv-heads 1
  both short "4,512 8,2048 32,1024 64,512 256,512"
  both long "1,131072 2,65536 4,32768 8,16384"
  for d in 64 80 96 192 256; do
    bench "prefill_d$d" --suite prefill --head-dim $d --cases "4,4096 2,8192" --reps 20
    peers "prefill_d$d" --no-limits --decode none --prefill "4,4096 2,8192" --head-dim $d
  done
  bench prefill_f16 --suite prefill --dtype float16 --cases "2,8192" --reps 20
  peers prefill_f16 --no-limits --decode none --prefill "2,8192" --dtype float16
  # Layer attention variants (docs/PERFORMANCE.md#attention-variants): a 4096 window over long
  # contexts against plain 4096 decodes, the soft-cap and sinks on the default shapes.
  both window "1,32768 16,32768 64,32768" --window 4096
  bench decode_4096 --cases "1,4096 16,4096 64,4096" --reps 30
  both softcap "$defaults" --softcap 30
  bench sinks --cases "$defaults" --reps 30 --sinks
  bench prefill_softcap --suite prefill --softcap 30 --reps 10
  bench prefill_sinks --suite prefill --sinks --reps 10
  peers prefill_softcap --no-limits --decode none --softcap 30
  bench prefill_window --suite prefill --window 4096 --cases "1,16384" --reps 10
  peers prefill_window --no-limits --decode none --prefill "1,16384" --window 4096
  # FP8 caches (docs/PERFORMANCE.md#fp8-caches): both scalings, FP8 prefill, FlashInfer's FP8
  # decode (its SDPA peers read no FP8 cache).
  bench decode_fp8 --dtype float8_e4m3 --reps 30
  bench decode_fp8_static --dtype float8_e4m3 --kv-scaling static --reps 30
  bench prefill_fp8 --suite prefill --dtype float8_e4m3 --reps 10
  peers decode_fp8 --no-limits --prefill none --kv-dtype float8_e4m3
fi

# What the SM allows a tile (docs/PERFORMANCE.md#known-gaps): wgmma beside the special function
# unit's ex2, into OUT_DIR/pipe_probe.json.
probe_bin=$build/kernels/bench/pagedattn-pipe-probe
if [ ! -x "$probe_bin" ]; then
  echo "pipe probe: not built ($probe_bin: a build with sm_90a)"
else
  timeout "$timeout_s" "$probe_bin" --json "$out/pipe_probe.json" > "$out/logs/pipe_probe.log" 2>&1 ||
    echo "pipe probe failed rc=$? (logs/pipe_probe.log)"
fi

# The phase timelines of a profile build (kernels/README.md#tests-and-benchmark).
if [ -n "${PROFILE_BUILD:-}" ]; then
  prof_bin=$PROFILE_BUILD/kernels/bench/pagedattn-bench
  mkdir -p "$out/profile"
  # profile NAME [FLAGS...]: one timeline run, its stamps to profile/NAME.json.
  profile() {
    local name=$1
    shift
    timeout "$timeout_s" "$prof_bin" "$@" --profile "$out/profile/$name.json" \
      > /dev/null 2> "$out/logs/profile_$name.log" ||
      echo "profile $name failed rc=$? (logs/profile_$name.log)"
  }
  if [ ! -x "$prof_bin" ]; then
    echo "profile: not built ($prof_bin)"
  elif ! "$prof_bin" --cases none --profile /dev/null > /dev/null 2>&1; then
    echo "profile: $prof_bin has no phase stamps (configure with -DPAGEDATTN_PROFILE=ON)"
  else
    profile decode --reps 10
    profile decode_fp8 --dtype float8_e4m3 --reps 10
    profile prefill --suite prefill --reps 3
  fi
fi

python3 "$here/compare.py" "$out/ours" "$out/peers"
