#!/usr/bin/env bash
# deploy/lib/supervise.sh — keeps one process of the local stack running (used by
# deploy/local-stack.sh for the api and each worker).
#
#   supervise.sh NAME LOG CHILD_PIDFILE NOTICES -- CMD ARGS...
#
# Runs CMD (stdin /dev/null, output appended to LOG) and, when it exits — crashed, killed -9,
# out of memory — starts it again after a short backoff (1 s, doubling to 10 s; back to 1 s once a
# run lasted 30 s), writing one line per restart to LOG and to NOTICES (which the foreground
# local-stack.sh shows on the terminal). CHILD_PIDFILE holds the current child's pid and start
# time (deploy/lib/common.sh write_pidfile). SIGTERM, SIGINT or SIGHUP stop the supervisor: the
# child gets SIGTERM and the supervisor waits for it (the caller's stop timeout applies), then
# exits 0 without restarting anything.
set -u

name=$1 log=$2 child_pidfile=$3 notices=$4
shift 4
[[ ${1:-} == -- ]] && shift

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
trap - EXIT

stopping=0
child=
on_stop() {
    stopping=1
    if [[ -n $child ]]; then
        kill -TERM "$child" 2>/dev/null || true
    fi
}
trap on_stop TERM INT HUP

notice() {
    local line
    line="$(date +%H:%M:%S) local-stack: $*"
    printf '%s\n' "$line" >>"$log"
    printf '%s\n' "$line" >>"$notices"
}

delay=1
restarts=0
while :; do
    started=$SECONDS
    "$@" </dev/null >>"$log" 2>&1 &
    child=$!
    write_pidfile "$child_pidfile" "$child"
    status=0
    wait "$child" || status=$?
    # A trapped signal interrupts `wait`: wait again until the child itself has exited.
    while kill -0 "$child" 2>/dev/null; do
        status=0
        wait "$child" || status=$?
    done
    rm -f "$child_pidfile"
    if ((stopping)); then
        exit 0
    fi
    if ((SECONDS - started >= 30)); then
        delay=1
    fi
    restarts=$((restarts + 1))
    if ((status > 128)); then
        why="was killed by signal $((status - 128))"
    else
        why="exited with status $status"
    fi
    notice "$name (pid $child) $why; restarting it in ${delay}s (restart #$restarts)"
    child=
    sleep "$delay" &
    wait $! || true
    if ((stopping)); then
        exit 0
    fi
    delay=$((delay * 2 > 10 ? 10 : delay * 2))
done
