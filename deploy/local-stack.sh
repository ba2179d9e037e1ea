#!/usr/bin/env bash
# deploy/local-stack.sh — run the whole of agentloop on this machine, for development.
#
#   ./deploy/local-stack.sh              build, migrate, start everything, stay in the foreground
#                                        (Ctrl-C or SIGTERM stops everything it started)
#   ./deploy/local-stack.sh --detach     the same, but return once it is ready and leave it running
#   ./deploy/local-stack.sh stop         stop a detached stack (pid files in .stack/run)
#   ./deploy/local-stack.sh status       what is running
#   ./deploy/local-stack.sh smoke        run the printed curl example against the running stack
#   Options: --no-build (use the binaries in target/debug as they are), --workers N (default 2)
#
# What it starts: PostgreSQL if none is reachable (deploy/lib/postgres.sh: the machine's server
# on 127.0.0.1:5432 with trust auth, else a throwaway cluster in .stack/pg), database
# `agentloop_<checksum of this checkout's path>` (AGENTLOOP_DB_NAME overrides),
# migrations, an API key for principal `local`, a model endpoint (MODEL_BASE_URL if set, else the
# test mock `mock-model`), one `agentloop-api run` and N `agentloop-worker run` (local-1..N).
# The api and each worker run under deploy/lib/supervise.sh: one that dies (crash, kill -9) is
# started again after a short backoff (1 s doubling to 10 s) with a line on the terminal and in
# .stack/logs/restarts.log — in the foreground and with --detach; Ctrl-C / `stop` stop it all.
# Logs: .stack/logs/*.log. State: .stack/run/ (supervisors' pid files; children's in run/child/).
#
# Environment (all optional):
#   API_LISTEN            default 127.0.0.1:8080
#   DATABASE_URL          use this database instead of creating the checkout's own
#   PG_ADMIN_URL          server to create `agentloop` on (see deploy/lib/postgres.sh)
#   AGENTLOOP_FORCE_THROWAWAY_PG=1   ignore the server on 5432; use a throwaway cluster
#   MODEL_BASE_URL, MODEL_NAME, MODEL_API_KEY, MODEL_CONTEXT_TOKENS   a real endpoint
#   MODELS_FILE           a models JSON file instead of the single-model variables
#   RUST_LOG (default info), LOG_FORMAT (default text), WORKERS (default 2)
#   CARGO_TARGET_DIR, STACK_DIR (default .stack)
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/postgres.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/postgres.sh"

RUN_DIR="$STACK_DIR/run"
LOG_DIR="$STACK_DIR/logs"
TARGET_DIR="${CARGO_TARGET_DIR:-$AGENTLOOP_ROOT/target}"
BIN_DIR="$TARGET_DIR/debug"
API_LISTEN="${API_LISTEN:-127.0.0.1:8080}"
WORKERS="${WORKERS:-2}"
export RUST_LOG="${RUST_LOG:-info}"
export LOG_FORMAT="${LOG_FORMAT:-text}"

usage() {
    sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# --- children ---------------------------------------------------------------------------------

CHILD_NAMES=()
CHILD_PIDS=()
STACK_KEEP=0 # set once a --detach start succeeded: then nothing is stopped on exit

rotate_log() {
    if [[ -s $1 ]]; then
        mv -f "$1" "$1.1"
    fi
    : >"$1"
}

# start_child NAME CMD ARGS... — in its own session (so a terminal's Ctrl-C reaches only this
# script, which then stops children in order), stdin from /dev/null, output to .stack/logs/NAME.log.
start_child() {
    local name=$1 pid
    shift
    rotate_log "$LOG_DIR/$name.log"
    setsid "$@" </dev/null >>"$LOG_DIR/$name.log" 2>&1 &
    pid=$!
    write_pidfile "$RUN_DIR/$name.pid" "$pid"
    CHILD_NAMES+=("$name")
    CHILD_PIDS+=("$pid")
}

# start_supervised NAME CMD ARGS... — like start_child, but under deploy/lib/supervise.sh, which
# restarts CMD when it dies. The pid file holds the supervisor; run/child/NAME.pid the process.
start_supervised() {
    local name=$1 pid
    shift
    rotate_log "$LOG_DIR/$name.log"
    mkdir -p "$RUN_DIR/child"
    setsid "$AGENTLOOP_ROOT/deploy/lib/supervise.sh" "$name" "$LOG_DIR/$name.log" "$RUN_DIR/child/$name.pid" \
        "$LOG_DIR/restarts.log" -- "$@" </dev/null >>"$LOG_DIR/$name.log" 2>&1 &
    pid=$!
    write_pidfile "$RUN_DIR/$name.pid" "$pid"
    CHILD_NAMES+=("$name")
    CHILD_PIDS+=("$pid")
}

# Stops supervised processes a supervisor left behind (it was killed before its child stopped).
stop_orphans() {
    local f pid
    for f in "$RUN_DIR"/child/*.pid; do
        [[ -e $f ]] || continue
        if pid="$(pidfile_alive "$f")"; then
            stop_pid "$pid" "$(basename "$f" .pid)" 80
        fi
        rm -f "$f"
    done
}

# Stops the given pid files' processes together: SIGTERM to all, then wait (SIGKILL after the
# timeout). Workers get 80 s, as systemd/k8s give them: a tool call with external effects in
# flight is waited for up to WORKER_EFFECT_DRAIN_MS (65 s); otherwise they exit within ~10 s.
stop_pidfiles() {
    local timeout=$1 f pid name pids=() names=() files=() i
    shift
    for f in "$@"; do
        [[ -e $f ]] || continue
        if pid="$(pidfile_alive "$f")"; then
            name="$(basename "$f" .pid)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
            names+=("$name")
        fi
        files+=("$f")
    done
    for i in "${!pids[@]}"; do
        stop_pid "${pids[i]}" "${names[i]}" "$timeout"
    done
    # Reap our own children so they do not linger as zombies.
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    if ((${#files[@]})); then
        rm -f "${files[@]}"
    fi
    if ((${#names[@]})); then
        log "stopped ${names[*]}"
    fi
}

stop_stack_processes() {
    local workers=() f
    for f in "$RUN_DIR"/worker-*.pid; do
        [[ -e $f ]] && workers+=("$f")
    done
    if ((${#workers[@]})); then
        stop_pidfiles 80 "${workers[@]}"
    fi
    stop_pidfiles 15 "$RUN_DIR/api.pid"
    stop_orphans
    stop_pidfiles 10 "$RUN_DIR/mock-model.pid" "$RUN_DIR/real-model.pid"
}

# Exit hook of a foreground run, or of a --detach run that failed to start.
on_stack_exit() {
    ((STACK_KEEP)) && return 0
    if ((${#CHILD_PIDS[@]})); then
        log "stopping the stack ..."
    fi
    local workers=() name
    for name in "${CHILD_NAMES[@]}"; do
        [[ $name == worker-* ]] && workers+=("$RUN_DIR/$name.pid")
    done
    if ((${#workers[@]})); then
        stop_pidfiles 80 "${workers[@]}"
    fi
    stop_pidfiles 15 "$RUN_DIR/api.pid"
    stop_orphans
    stop_pidfiles 10 "$RUN_DIR/mock-model.pid"
    rm -f "$RUN_DIR/stack.env"
    if [[ -e $RUN_DIR/pg.owned ]]; then
        rm -f "$RUN_DIR/pg.owned"
        stop_throwaway_postgres
    fi
}

running_pids() {
    local f pid out=""
    for f in "$RUN_DIR"/api.pid "$RUN_DIR"/worker-*.pid "$RUN_DIR"/mock-model.pid; do
        [[ -e $f ]] || continue
        if pid="$(pidfile_alive "$f")"; then
            out+="$(basename "$f" .pid)=$pid "
        else
            rm -f "$f"
        fi
    done
    printf '%s' "${out% }"
}

# --- steps ------------------------------------------------------------------------------------

probe_host() {
    local host=${API_LISTEN%:*}
    case $host in
        "" | 0.0.0.0 | "[::]" | "::") host=127.0.0.1 ;;
    esac
    printf '%s\n' "$host"
}

build() {
    if [[ ${AGENTLOOP_SKIP_BUILD:-0} == 1 ]]; then
        log "skipping cargo build (--no-build)"
    else
        log "cargo build --workspace (log: $LOG_DIR/build.log) ..."
        local t0=$SECONDS
        (cd "$AGENTLOOP_ROOT" && cargo build --workspace) 2>&1 | tee "$LOG_DIR/build.log" >&2 ||
            die "cargo build --workspace failed (log: $LOG_DIR/build.log)"
        log "built in $((SECONDS - t0))s"
    fi
    local b
    for b in agentloop-api agentloop-worker; do
        [[ -x $BIN_DIR/$b ]] || die "$BIN_DIR/$b is missing (build with: cargo build --workspace)"
    done
}

migrate_and_key() {
    rotate_log "$LOG_DIR/migrate.log"
    if ! "$BIN_DIR/agentloop-worker" migrate </dev/null >>"$LOG_DIR/migrate.log" 2>&1; then
        show_log_tail "$LOG_DIR/migrate.log"
        die "agentloop-worker migrate failed (log: $LOG_DIR/migrate.log)"
    fi
    local out
    # Reuse the key of an earlier start while it is still live (list-keys shows live keys only),
    # instead of minting a new live key every time.
    if [[ -s $STACK_DIR/api-key ]]; then
        out="$(head -n1 "$STACK_DIR/api-key")"
        if "$BIN_DIR/agentloop-worker" list-keys --principal local </dev/null 2>>"$LOG_DIR/migrate.log" |
            awk -v p="${out:0:10}" '$2 == p { found = 1 } END { exit !found }'; then
            API_KEY=$out
            return 0
        fi
    fi
    if ! out="$("$BIN_DIR/agentloop-worker" create-key --principal local --name local-stack </dev/null 2>>"$LOG_DIR/migrate.log")"; then
        show_log_tail "$LOG_DIR/migrate.log"
        die "agentloop-worker create-key --principal local failed (log: $LOG_DIR/migrate.log)"
    fi
    out="$(printf '%s' "$out" | tr -d '\r' | sed '/^[[:space:]]*$/d')"
    [[ $out =~ ^al_[^[:space:]]+$ ]] || die "create-key printed something other than one al_... key: '$out'"
    API_KEY=$out
    (
        umask 077
        printf '%s\n' "$API_KEY" >"$STACK_DIR/api-key"
    )
}

start_model() {
    if [[ -n ${MODEL_BASE_URL:-} ]]; then
        [[ -n ${MODEL_NAME:-} ]] || die "MODEL_BASE_URL is set; set MODEL_NAME too (the upstream model name)"
        export MODEL_BASE_URL MODEL_NAME
        if [[ -n ${MODEL_API_KEY:-} ]]; then export MODEL_API_KEY; fi
        if [[ -n ${MODEL_CONTEXT_TOKENS:-} ]]; then export MODEL_CONTEXT_TOKENS; fi
        if [[ -n ${MODEL_SUPPORTS_TOOLS:-} ]]; then export MODEL_SUPPORTS_TOOLS; fi
        MODEL_DESC="$MODEL_NAME at $MODEL_BASE_URL"
        return 0
    fi
    if [[ -n ${MODELS_FILE:-} ]]; then
        [[ -r $MODELS_FILE ]] || die "MODELS_FILE=$MODELS_FILE is not readable"
        export MODELS_FILE
        MODEL_DESC="models from $MODELS_FILE"
        return 0
    fi
    [[ -x $BIN_DIR/mock-model ]] || die "$BIN_DIR/mock-model is missing (build with: cargo build --workspace)"
    start_child mock-model "$BIN_DIR/mock-model" --listen 127.0.0.1:0
    local line
    line="$(wait_for_line "$LOG_DIR/mock-model.log" '^MOCK_MODEL_URL=http' 30 "${CHILD_PIDS[-1]}")" || {
        show_log_tail "$LOG_DIR/mock-model.log"
        die "mock-model did not print MOCK_MODEL_URL=... (log: $LOG_DIR/mock-model.log)"
    }
    export MODEL_BASE_URL="${line#MOCK_MODEL_URL=}/v1"
    export MODEL_NAME=mock
    MODEL_DESC="mock (the test mock model) at $MODEL_BASE_URL"
}

start_services() {
    local host=${API_LISTEN%:*} port=${API_LISTEN##*:} i
    [[ $port =~ ^[0-9]+$ ]] || die "API_LISTEN=$API_LISTEN: expected HOST:PORT"
    if port_in_use "$(probe_host)" "$port"; then
        die "something already listens on $API_LISTEN (another stack? ./deploy/local-stack.sh stop, or set API_LISTEN=$host:$((port + 1)))"
    fi
    : >"$LOG_DIR/restarts.log"
    start_supervised api env API_LISTEN="$API_LISTEN" DEV_LOOPBACK_PRINCIPAL=true MIGRATE_ON_START=false \
        "$BIN_DIR/agentloop-api" run
    for ((i = 1; i <= WORKERS; i++)); do
        start_supervised "worker-local-$i" env WORKER_ID="local-$i" "$BIN_DIR/agentloop-worker" run
    done
}

wait_ready() {
    local url i j
    url="http://$(probe_host):${API_LISTEN##*:}/readyz"
    for ((i = 0; i < 600; i++)); do
        if curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; then
            return 0
        fi
        for j in "${!CHILD_PIDS[@]}"; do
            if ! kill -0 "${CHILD_PIDS[j]}" 2>/dev/null; then
                show_log_tail "$LOG_DIR/${CHILD_NAMES[j]}.log"
                die "${CHILD_NAMES[j]} exited during start-up (log: $LOG_DIR/${CHILD_NAMES[j]}.log)"
            fi
        done
        # A supervised process that dies while starting is a configuration problem: say so now.
        if [[ -s $LOG_DIR/restarts.log ]]; then
            local name
            name="$(sed -n '1s/^[0-9:]* local-stack: \([^ ]*\) .*/\1/p' "$LOG_DIR/restarts.log")"
            show_log_tail "$LOG_DIR/${name:-api}.log"
            die "${name:-a process} exited during start-up (log: $LOG_DIR/${name:-api}.log)"
        fi
        sleep 0.1
    done
    show_log_tail "$LOG_DIR/api.log"
    die "$url did not answer 200 within 60s (log: $LOG_DIR/api.log)"
}

json_id_cmd() {
    if command -v jq >/dev/null 2>&1; then
        printf '%s' "jq -r .id"
    else
        printf '%s' "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"id\"])'"
    fi
}

banner() {
    local base pretty=cat
    base="http://$(probe_host):${API_LISTEN##*:}"
    command -v jq >/dev/null 2>&1 && pretty="jq ."
    cat <<EOF

agentloop is running.
  Open:      $base/            (web UI; loopback requests act as the local principal)
  API key:   $API_KEY     (principal "local"; also in ${STACK_DIR#"$AGENTLOOP_ROOT"/}/api-key)
  Database:  $(_pg_redact "$DATABASE_URL")
  Model:     $MODEL_DESC
  Workers:   $WORKERS (local-1..local-$WORKERS)
  Logs:      ${LOG_DIR#"$AGENTLOOP_ROOT"/}/{api,worker-local-*,mock-model,migrate,restarts}.log
  Restarts:  a worker or the api that dies is started again (kill -9 one to see recovery)
  Stop:      $STOP_HINT

Try it (copy-paste):
  export AGENTLOOP_URL=$base AGENTLOOP_API_KEY=$API_KEY
  ID=\$(curl -sS -X POST "\$AGENTLOOP_URL/api/threads" -H "Authorization: Bearer \$AGENTLOOP_API_KEY" \\
        -H 'Content-Type: application/json' -d '{"title":"demo"}' | $(json_id_cmd)); echo "thread \$ID"
  curl -sS -i -X POST "\$AGENTLOOP_URL/api/threads/\$ID/chat" -H "Authorization: Bearer \$AGENTLOOP_API_KEY" \\
        -H 'Content-Type: application/json' -d '{"content":"What is 12*7? Use the calculator."}'   # 202
  curl -sS -N --max-time 30 "\$AGENTLOOP_URL/api/threads/\$ID/updates/stream?afterSequence=0" \\
        -H "Authorization: Bearer \$AGENTLOOP_API_KEY"   # live updates (SSE); Ctrl-C when done
  curl -sS "\$AGENTLOOP_URL/api/threads/\$ID" -H "Authorization: Bearer \$AGENTLOOP_API_KEY" | $pretty

EOF
}

write_stack_env() {
    {
        printf 'AGENTLOOP_URL=%q\n' "http://$(probe_host):${API_LISTEN##*:}"
        printf 'AGENTLOOP_API_KEY=%q\n' "$API_KEY"
        printf 'DATABASE_URL=%q\n' "$DATABASE_URL"
        printf 'MODEL_NAME=%q\n' "${MODEL_NAME:-}"
        printf 'MODEL_DESC=%q\n' "$MODEL_DESC"
    } >"$RUN_DIR/stack.env"
}

# --- commands ---------------------------------------------------------------------------------

cmd_up() {
    local detach=$1 t0=$SECONDS
    [[ $WORKERS =~ ^[1-9][0-9]*$ ]] || die "WORKERS/--workers must be >= 1 (got '$WORKERS')"
    mkdir -p "$RUN_DIR" "$LOG_DIR"
    local running
    running="$(running_pids)"
    [[ -z $running ]] || die "a stack is already running ($running); stop it with: ./deploy/local-stack.sh stop"
    command -v curl >/dev/null 2>&1 || die "curl is needed (apt-get install -y curl)"

    if ((detach)); then
        export AGENTLOOP_PG_KEEP_RUNNING=1
    fi
    ensure_postgres # registers its own exit hook first, so it runs after on_stack_exit
    if ((AGENTLOOP_PG_STARTED)) && ((detach)); then
        : >"$RUN_DIR/pg.owned" # `stop` stops the cluster a detached stack started
    fi
    on_exit on_stack_exit
    if [[ -z ${DATABASE_URL:-} ]]; then
        # One database per checkout, so two checkouts on one machine never share a run queue.
        ensure_database "${AGENTLOOP_DB_NAME:-agentloop_$(printf '%s' "$AGENTLOOP_ROOT" | cksum | cut -d' ' -f1)}"
    fi
    export DATABASE_URL

    build
    migrate_and_key
    start_model
    start_services
    wait_ready
    write_stack_env

    if ((detach)); then
        STOP_HINT="./deploy/local-stack.sh stop"
        banner
        log "ready in $((SECONDS - t0))s; detached"
        STACK_KEEP=1
        return 0
    fi
    STOP_HINT="Ctrl-C here (or: ./deploy/local-stack.sh stop)"
    banner
    log "ready in $((SECONDS - t0))s; Ctrl-C stops everything"

    # Foreground: the supervisors restart what dies (their lines appear here); if a supervisor
    # itself dies, report it and stop the rest.
    tail -n0 -F "$LOG_DIR/restarts.log" >&2 2>/dev/null &
    local tailer=$!
    on_exit "kill $tailer 2>/dev/null || true"
    local exited="" status=0 i
    wait -n -p exited "${CHILD_PIDS[@]}" || status=$?
    for i in "${!CHILD_PIDS[@]}"; do
        if [[ ${CHILD_PIDS[i]} == "$exited" ]]; then
            show_log_tail "$LOG_DIR/${CHILD_NAMES[i]}.log"
            die "${CHILD_NAMES[i]} (pid $exited) exited with status $status; stopping the stack"
        fi
    done
    die "a child exited (status $status); stopping the stack"
}

cmd_stop() {
    mkdir -p "$RUN_DIR"
    stop_stack_processes
    rm -f "$RUN_DIR/stack.env"
    if [[ -e $RUN_DIR/pg.owned ]]; then
        rm -f "$RUN_DIR/pg.owned"
        stop_throwaway_postgres
    fi
}

cmd_status() {
    local f pid any=0
    local child restarts
    for f in "$RUN_DIR"/*.pid; do
        [[ -e $f ]] || continue
        any=1
        if pid="$(pidfile_alive "$f")"; then
            if [[ -e $RUN_DIR/child/$(basename "$f") ]]; then
                child="$(pidfile_alive "$RUN_DIR/child/$(basename "$f")" || echo restarting)"
                restarts="$(grep -c " local-stack: $(basename "$f" .pid) " "$LOG_DIR/restarts.log" 2>/dev/null || true)"
                printf '  %-16s running (pid %s, supervisor %s, %s restart(s))\n' "$(basename "$f" .pid)" "$child" "$pid" "${restarts:-0}"
            else
                printf '  %-16s running (pid %s)\n' "$(basename "$f" .pid)" "$pid"
            fi
        else
            printf '  %-16s not running (stale pid file)\n' "$(basename "$f" .pid)"
        fi
    done
    ((any)) || echo "  no stack processes recorded in $RUN_DIR"
    if [[ -r $RUN_DIR/stack.env ]]; then
        # shellcheck disable=SC1091
        source "$RUN_DIR/stack.env"
        echo "  url: $AGENTLOOP_URL   model: $MODEL_DESC"
        if curl -fsS -o /dev/null --max-time 2 "$AGENTLOOP_URL/readyz"; then
            echo "  /readyz: ok"
        else
            echo "  /readyz: NOT ready"
        fi
    fi
    if _pg_load_state && [[ -x $PG_BINDIR/pg_ctl ]]; then
        _pg_choose_owner
        if _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
            echo "  throwaway postgres: running on 127.0.0.1:$PG_PORT ($PG_DATA)"
        else
            echo "  throwaway postgres: stopped ($PG_DATA)"
        fi
    fi
}

# Runs the banner's example and checks the status codes. Exit 0 if the run finished.
cmd_smoke() {
    [[ -r $RUN_DIR/stack.env ]] || die "no running stack recorded in $RUN_DIR (start one with --detach)"
    # shellcheck disable=SC1091
    source "$RUN_DIR/stack.env"
    local url=$AGENTLOOP_URL auth="Authorization: Bearer $AGENTLOOP_API_KEY" body code id i
    local tmp
    tmp="$(mktemp -d)"
    on_exit "rm -rf '$tmp'"

    code="$(curl -sS -o "$tmp/thread.json" -w '%{http_code}' -X POST "$url/api/threads" -H "$auth" \
        -H 'Content-Type: application/json' -d '{"title":"demo"}')"
    [[ $code == 201 ]] || die "POST /api/threads -> $code: $(cat "$tmp/thread.json")"
    id="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$tmp/thread.json")" ||
        die "no id in the created thread: $(cat "$tmp/thread.json")"
    echo "smoke: POST /api/threads -> 201, thread $id"

    code="$(curl -sS -o "$tmp/chat.json" -w '%{http_code}' -X POST "$url/api/threads/$id/chat" -H "$auth" \
        -H 'Content-Type: application/json' -d '{"content":"What is 12*7? Use the calculator."}')"
    [[ $code == 202 ]] || die "POST /api/threads/$id/chat -> $code: $(cat "$tmp/chat.json")"
    echo "smoke: POST /api/threads/$id/chat -> 202"

    curl -sS -N --max-time "${SMOKE_STREAM_SECONDS:-10}" "$url/api/threads/$id/updates/stream?afterSequence=0" -H "$auth" \
        >"$tmp/stream.txt" 2>/dev/null || true
    echo "smoke: SSE stream gave $(grep -c '^data:' "$tmp/stream.txt" || true) events in ${SMOKE_STREAM_SECONDS:-10}s"

    for ((i = 0; i < ${SMOKE_TIMEOUT:-60}; i++)); do
        code="$(curl -sS -o "$tmp/window.json" -w '%{http_code}' "$url/api/threads/$id" -H "$auth")"
        [[ $code == 200 ]] || die "GET /api/threads/$id -> $code: $(cat "$tmp/window.json")"
        if python3 - "$tmp/window.json" <<'EOF'; then
import json, sys
w = json.load(open(sys.argv[1]))
run = w.get("run")
status = (run or {}).get("status")
if status in ("failed", "cancelled"):
    print(f"smoke: the run ended {status}: {json.dumps(run.get('error'))}", file=sys.stderr)
if status in ("waiting_approval", "waiting_authorization", "blocked"):
    sys.exit(2)
sys.exit(0 if not run or status in ("completed", "failed", "cancelled") else 1)
EOF
            waiting=0
        else
            waiting=$?
        fi
        if ((waiting == 2)); then
            # A tool with policy `ask` (TOOLS_FILE), an MCP sign-in or an uncertain effect: the
            # stack works up to a decision smoke must not take for the user.
            echo "smoke: the run waits for a human: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["run"]; print(r["status"], "-", (r.get("error") or {}).get("message") or "decide in the UI")' "$tmp/window.json")"
            echo "smoke: OK up to that decision (open $url/#$id to approve, reject or resolve it)"
            return 0
        fi
        if ((waiting == 0)); then
            body="$(cat "$tmp/window.json")"
            echo "smoke: GET /api/threads/$id -> 200; final window:"
            if command -v jq >/dev/null 2>&1; then jq . <<<"$body"; else echo "$body"; fi
            if [[ $body == *'"status":"failed"'* || $body == *'"status":"cancelled"'* ]]; then
                die "the run did not complete"
            fi
            if [[ $MODEL_NAME == mock ]] && [[ $body != *84* ]]; then
                die "the mock model's answer to 12*7 (84) is not in the thread"
            fi
            echo "smoke: OK"
            return 0
        fi
        sleep 1
    done
    die "the run did not finish within ${SMOKE_TIMEOUT:-60}s; last window: $(cat "$tmp/window.json")"
}

main() {
    local cmd=up detach=0
    while (($#)); do
        case $1 in
            --detach | -d) detach=1 ;;
            --no-build) export AGENTLOOP_SKIP_BUILD=1 ;;
            --workers)
                [[ $# -ge 2 ]] || die "--workers needs a number"
                WORKERS=$2
                shift
                ;;
            --workers=*) WORKERS=${1#--workers=} ;;
            up | start) cmd=up ;;
            stop | status | smoke) cmd=$1 ;;
            -h | --help | help)
                usage
                return 0
                ;;
            *) die "unknown argument '$1' (see --help)" ;;
        esac
        shift
    done
    case $cmd in
        up) cmd_up "$detach" ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        smoke) cmd_smoke ;;
    esac
}

main "$@"
