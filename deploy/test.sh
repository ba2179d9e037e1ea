#!/usr/bin/env bash
# deploy/test.sh — build everything and run the whole test suite against a real PostgreSQL.
#
#   ./deploy/test.sh                       all tests
#   ./deploy/test.sh scheduler --nocapture extra arguments go to the test binaries (after --)
#   ./deploy/test.sh chaos [ARGS]          the chaos soak instead: builds the release binaries and
#                                          runs `chaos ARGS` (default --runs 2000; e.g. --seed 42,
#                                          --duration 20m, --faults all,-restart, --keep) on its
#                                          own private PostgreSQL cluster; logs and report.json in
#                                          test-output/chaos/; exit status: the harness's (0 ok,
#                                          1 an invariant violated, 2 harness error)
#
# PostgreSQL comes from deploy/lib/postgres.sh (PG_ADMIN_URL / DATABASE_URL if set, else the
# machine's server on 127.0.0.1:5432 with trust auth, else a throwaway cluster in .stack/pg,
# stopped again at the end; AGENTLOOP_FORCE_THROWAWAY_PG=1 skips the 5432 probe).
# The tests get TEST_DATABASE_URL (a role that can CREATE DATABASE): each test creates its own
# database from a template.
#
# Environment: TEST_THREADS (default 4), RUST_BACKTRACE (default 1), CARGO_TARGET_DIR.
# Output: also written to test-output/{build,test}.log and test-output/summary.txt.
# Exit status: cargo's.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/postgres.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/postgres.sh"

OUT_DIR="$AGENTLOOP_ROOT/test-output"
TEST_THREADS="${TEST_THREADS:-4}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"

mkdir -p "$OUT_DIR"
cd "$AGENTLOOP_ROOT"

if [[ ${1:-} == chaos ]]; then
    shift
    # The harness starts its own cluster with the server binaries (PgCluster); no shared server.
    if [[ -z "$(_pg_server_bindir || true)" ]]; then
        _pg_apt_install postgresql
    fi
    mkdir -p "$OUT_DIR/chaos"
    log "cargo build --release --workspace --bins"
    cargo build --release --workspace --bins 2>&1 | tee "$OUT_DIR/chaos/build.log"
    log "chaos $* (default --runs 2000)"
    chaos_status=0
    "${CARGO_TARGET_DIR:-$AGENTLOOP_ROOT/target}/release/chaos" --no-build "$@" 2>&1 |
        tee "$OUT_DIR/chaos/chaos.log" || chaos_status=$?
    log "chaos exit $chaos_status; output in test-output/chaos/"
    exit "$chaos_status"
fi

rm -f "$OUT_DIR/build.log" "$OUT_DIR/test.log" "$OUT_DIR/summary.txt"

t0=$SECONDS
ensure_postgres
export TEST_DATABASE_URL="$PG_ADMIN_URL"
log "TEST_DATABASE_URL=$(_pg_redact "$TEST_DATABASE_URL")"

summary() {
    {
        printf 'date: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        printf 'commit: %s\n' "$(git -C "$AGENTLOOP_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
        printf 'postgres: %s\n' "$(_pg_redact "$TEST_DATABASE_URL")"
        printf 'test threads: %s\n' "$TEST_THREADS"
        printf '%s\n' "$@"
        if [[ -r $OUT_DIR/test.log ]]; then
            grep -E '^test result:|^error(\[|:)|panicked at|^failures:$|^    [A-Za-z0-9_:]+$' "$OUT_DIR/test.log" || true
        fi
    } >"$OUT_DIR/summary.txt"
}

# The contract test (tests/tests/contract.rs) runs schemathesis from a venv under .stack/.
SCHEMATHESIS_VERSION=4.32.5
installed="$("$AGENTLOOP_ROOT/.stack/venv/bin/pip" show schemathesis 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ ! -x $AGENTLOOP_ROOT/.stack/venv/bin/st || $installed != "$SCHEMATHESIS_VERSION" ]]; then
    log "installing schemathesis $SCHEMATHESIS_VERSION into .stack/venv (PyPI)"
    mkdir -p "$AGENTLOOP_ROOT/.stack"
    python3 -m venv "$AGENTLOOP_ROOT/.stack/venv" && "$AGENTLOOP_ROOT/.stack/venv/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION" ||
        log "schemathesis could not be installed; contract_schemathesis_finds_no_failures will skip (and fail under CI=true)"
fi

build_status=0
log "cargo build --workspace --all-targets"
cargo build --workspace --all-targets 2>&1 | tee "$OUT_DIR/build.log" || build_status=$?
if ((build_status != 0)); then
    summary "build: FAILED (exit $build_status) after $((SECONDS - t0))s" "test: not run"
    log "cargo build failed (exit $build_status); log: test-output/build.log"
    exit "$build_status"
fi
build_s=$((SECONDS - t0))

test_status=0
log "cargo test --workspace --no-fail-fast -- --test-threads=$TEST_THREADS $*"
cargo test --workspace --no-fail-fast -- --test-threads="$TEST_THREADS" "$@" 2>&1 | tee "$OUT_DIR/test.log" || test_status=$?
if ((test_status == 0)); then
    result=ok
else
    result="FAILED (exit $test_status)"
fi
summary "build: ok in ${build_s}s" "test: $result in $((SECONDS - t0 - build_s))s"
log "tests $result; total $((SECONDS - t0))s; output in test-output/"
exit "$test_status"
