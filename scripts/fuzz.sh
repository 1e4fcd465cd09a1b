#!/usr/bin/env bash
# The fuzz campaigns (not in CI at this size): the pgoutput decoder, the
# replication protocol's framing and compact's fast NDJSON line reader
# against the general parser, each a proptest property over valid inputs
# with a mutation fuzzer's edits (src/fuzzing.rs). The suite runs a few
# hundred or thousand cases of each; this runs WALTAIL_FUZZ_CASES of each
# (default 1,000,000) and prints each campaign's cases and time. A failure
# prints the smallest input it found and stores its seed under
# proptest-regressions/, so the suite repeats it from then on.
# Usage: scripts/fuzz.sh
#        WALTAIL_FUZZ_CASES=100000 scripts/fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export WALTAIL_FUZZ_CASES=${WALTAIL_FUZZ_CASES:-1000000}
filter='test(/::fuzz_|the_fast_path_agrees_with_the_general_one/)'
cargo nextest run --lib --profile long -E "$filter" --test-threads 2
echo "fuzzed: $WALTAIL_FUZZ_CASES cases of each campaign above, no panic, every property held"
