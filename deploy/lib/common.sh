# shellcheck shell=bash
# deploy/lib/common.sh — small helpers shared by the deploy scripts. Source it; do not run it.
#
#   AGENTLOOP_ROOT   repository root (resolved from this file's location)
#   STACK_DIR        scratch directory for local state (default: $AGENTLOOP_ROOT/.stack)
#   log / warn / die print to stderr; die exits 1.
#   on_exit CMD...   register a cleanup command; all run once, in reverse order, when the
#                    script exits (also after SIGINT/SIGTERM, which exit 130/143).

if [[ -n ${_AGENTLOOP_COMMON_LOADED:-} ]]; then
    return 0
fi
_AGENTLOOP_COMMON_LOADED=1

AGENTLOOP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)"
STACK_DIR="${STACK_DIR:-$AGENTLOOP_ROOT/.stack}"
export AGENTLOOP_ROOT STACK_DIR

_al_prog="$(basename "${0:-agentloop}")"

log() { printf '%s: %s\n' "$_al_prog" "$*" >&2; }
warn() { printf '%s: warning: %s\n' "$_al_prog" "$*" >&2; }
die() {
    printf '%s: ERROR: %s\n' "$_al_prog" "$*" >&2
    exit 1
}

# --- cleanup registry -------------------------------------------------------------------------
_AL_EXIT_HOOKS=()
_al_exiting=0

on_exit() {
    _AL_EXIT_HOOKS+=("$*")
}

_al_run_exit_hooks() {
    local status=$?
    if ((_al_exiting)); then
        return "$status"
    fi
    _al_exiting=1
    trap '' INT TERM
    local i
    for ((i = ${#_AL_EXIT_HOOKS[@]} - 1; i >= 0; i--)); do
        eval "${_AL_EXIT_HOOKS[i]}" || true
    done
    return "$status"
}

trap _al_run_exit_hooks EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- processes --------------------------------------------------------------------------------

# Start time of a live process in clock ticks since boot (field 22 of /proc/PID/stat); empty if
# it is gone or a zombie (an exited process whose parent, maybe PID 1, has not reaped it yet).
proc_starttime() {
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
    stat="${stat##*) }" # drop "pid (comm) "; the comm may contain spaces
    # shellcheck disable=SC2086 # deliberate word splitting of the stat fields
    set -- $stat
    [[ $1 == Z || $1 == X ]] && return 0
    printf '%s\n' "${20}"
}

# write_pidfile FILE PID: records "PID STARTTIME" so a recycled pid is never mistaken for ours.
write_pidfile() {
    printf '%s %s\n' "$2" "$(proc_starttime "$2")" >"$1"
}

# pidfile_alive FILE: prints the pid and succeeds if the recorded process is still the same one.
pidfile_alive() {
    local pid start
    [[ -r $1 ]] || return 1
    read -r pid start <"$1" || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -n $start && "$(proc_starttime "$pid")" == "$start" ]] || return 1
    printf '%s\n' "$pid"
}

# stop_pid PID NAME [TIMEOUT_S]: SIGTERM, wait up to TIMEOUT_S (default 25), then SIGKILL.
stop_pid() {
    local pid=$1 name=$2 timeout=${3:-25} start i
    start="$(proc_starttime "$pid")"
    [[ -n $start ]] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < timeout * 10; i++)); do
        [[ "$(proc_starttime "$pid")" == "$start" ]] || return 0
        sleep 0.1
    done
    warn "$name (pid $pid) did not stop within ${timeout}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

# port_in_use HOST PORT: something accepts TCP connections there.
port_in_use() {
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# wait_for_line FILE REGEX TIMEOUT_S PID: waits until FILE has a line matching REGEX (printed on
# stdout); fails early if PID exits.
wait_for_line() {
    local file=$1 re=$2 timeout=$3 pid=${4:-} i line
    for ((i = 0; i < timeout * 10; i++)); do
        if [[ -r $file ]]; then
            line="$(grep -E -m1 -- "$re" "$file" || true)"
            if [[ -n $line ]]; then
                printf '%s\n' "$line"
                return 0
            fi
        fi
        if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
            return 1
        fi
        sleep 0.1
    done
    return 1
}

# show_log_tail FILE: last lines of a log, indented, to stderr.
show_log_tail() {
    if [[ -s $1 ]]; then
        printf '  --- last lines of %s ---\n' "$1" >&2
        tail -n "${2:-25}" "$1" | sed 's/^/  | /' >&2
    fi
}
