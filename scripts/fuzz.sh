#!/usr/bin/env bash
# Short fuzz run of the wire decoder for CI: builds the libFuzzer targets in
# rust/tandem-core/fuzz on the stable toolchain and runs each for a bounded time, after
# replaying the seed corpus and every past crash in fuzz/regressions/.
#
#   scripts/fuzz.sh [SECONDS]     total fuzzing time, split over the targets (default 60)
#   FUZZ_SEED=N scripts/fuzz.sh   replay a run: the seed is printed at the start
#
# Exits non-zero on any crash; the failing input is written under
# rust/tandem-core/fuzz/artifacts/<target>/ and the command to reproduce it is printed.
# Build time (a few minutes from a cold cache) is not counted in SECONDS.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
total="${1:-60}"
seed="${FUZZ_SEED:-$(date +%s)}"
targets=(decode frame_reader)
per_target=$(( total / ${#targets[@]} ))
if (( per_target < 1 )); then
  echo "fuzz.sh: need at least ${#targets[@]} seconds, got ${total}" >&2
  exit 2
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# cargo-fuzz passes a few -Z flags to rustc; RUSTC_BOOTSTRAP lets the stable toolchain
# accept them. `-s none`: no sanitizer runtime (Rust code is memory safe; the fuzzer hunts
# panics and wrong answers, which need none).
export RUSTC_BOOTSTRAP=1
cd "$root/rust/tandem-core"

echo "fuzz.sh: seed ${seed}, ${per_target} s per target (${targets[*]})"
for target in "${targets[@]}"; do
  cargo fuzz build -s none "$target"
done

status=0
for target in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$target"
  echo "fuzz.sh: running $target for ${per_target} s"
  if ! cargo fuzz run -s none "$target" "fuzz/corpus/$target" fuzz/seeds fuzz/regressions -- \
      -max_total_time="$per_target" -seed="$seed" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 2>&1 | grep -v -E '^#[0-9]+ +(NEW|REDUCE|pulse)'; then
    status=1
  fi
done
if (( status != 0 )); then
  echo "fuzz.sh: FAILED (seed ${seed}); see the crash report above" >&2
else
  echo "fuzz.sh: no crash in $(( per_target * ${#targets[@]} )) s (seed ${seed})"
fi
exit "$status"
