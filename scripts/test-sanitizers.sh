#!/usr/bin/env bash
# The CPU-side tests (core, service end to end, hardening, security, data plane, sharding, IPC,
# random configs) under AddressSanitizer with UndefinedBehaviorSanitizer, then under
# ThreadSanitizer: two more builds (CPU backend only), in build-asan/ and build-tsan/. CI runs it
# after scripts/test.sh.
#   scripts/test-sanitizers.sh [asan|tsan]...        (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh > /dev/null
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(asan tsan)
tests=(core_test e2e_test hardening_test security_test data_plane_test sharded_test ipc_test
  config_fuzz_test)
supp=$PWD/tests/sanitizers
for kind in "${kinds[@]}"; do
  case $kind in
    asan) sanitize=address ;;
    tsan) sanitize=thread ;;
    *) echo "test-sanitizers.sh: unknown kind '$kind' (asan or tsan)" >&2; exit 2 ;;
  esac
  dir=build-$kind
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPAGEDATTN_CUDA=OFF \
    -DPAGEDATTN_SANITIZE=$sanitize > "$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
  ninja -C "$dir" -j"$(nproc)" "${tests[@]}" pagedattn-server
  # Full stacks for allocations: through gRPC (no frame pointers) the fast unwinder stops short
  # of the frames lsan.supp names.
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  # Debian's gRPC and absl are not built with TSan: accesses from inside them are not checked
  # (ignore_noninstrumented_modules), their locks are made visible by tsan_absl_mutex.cc.
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$supp/tsan.supp"
  for t in "${tests[@]}"; do
    echo "== $kind: $t"
    "$dir/tests/$t" --gtest_brief=1
  done
done
echo "test-sanitizers.sh: ${kinds[*]}: all passed"
