# shellcheck shell=bash
# deploy/lib/postgres.sh — find or start a PostgreSQL server for local runs and tests.
# Source it (it sources common.sh); do not run it.
#
# ensure_postgres
#     Exports PG_ADMIN_URL: a URL for a role that can CREATE DATABASE. In this order:
#       1. PG_ADMIN_URL if set (must connect), else DATABASE_URL if set (its server, as given);
#       2. unless AGENTLOOP_FORCE_THROWAWAY_PG=1: the server on 127.0.0.1:5432 if role
#          `postgres` gets in without a password (trust) -> postgres://postgres@127.0.0.1:5432/postgres
#       3. a throwaway cluster under $STACK_DIR/pg (default <repo>/.stack/pg): Debian's
#          `postgresql` package is installed first if no server binaries exist (needs root);
#          initdb/pg_ctl run as user `postgres` when called as root; trust auth, 127.0.0.1 only,
#          first free port from 54329 upwards, unix socket in $STACK_DIR/pg, fsync off
#          (it is disposable). Its port and data dir are recorded in $STACK_DIR/pg/cluster.env,
#          so a later call reuses (or restarts) the same cluster instead of creating another.
#     If this call started the cluster, it registers stop_throwaway_postgres to run when the
#     script exits — unless AGENTLOOP_PG_KEEP_RUNNING=1. AGENTLOOP_PG_STARTED=1 tells the
#     caller that this call started it.
#     Quiet when nothing needs doing; says one line when it installs or starts something.
#
# ensure_database NAME
#     Creates database NAME on PG_ADMIN_URL's server if absent; exports DATABASE_URL for it.
#
# stop_throwaway_postgres
#     Stops the throwaway cluster recorded in $STACK_DIR/pg (no-op if none is running).
#     Its data stays for the next run; `rm -rf .stack/pg` discards it.

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

AGENTLOOP_PG_FIRST_PORT="${AGENTLOOP_PG_FIRST_PORT:-54329}"

# Paths follow STACK_DIR as it is when a function runs (callers may set it after sourcing).
_pg_paths() {
    _AL_PG_DIR="$STACK_DIR/pg"
    _AL_PG_STATE="$_AL_PG_DIR/cluster.env"
}
_pg_paths

# --- helpers ----------------------------------------------------------------------------------

# _pg_url_with_db URL NAME: the same URL with its database path replaced by NAME.
_pg_url_with_db() {
    local url=$1 name=$2
    if [[ $url =~ ^(postgres(ql)?://[^/?]*)(/[^?]*)?(\?.*)?$ ]]; then
        printf '%s/%s%s\n' "${BASH_REMATCH[1]}" "$name" "${BASH_REMATCH[4]}"
    else
        die "not a postgres:// URL: $(_pg_redact "$url")"
    fi
}

# _pg_redact URL: hides a password in a URL for messages.
_pg_redact() {
    sed -E 's#(://[^:/@]+):[^@/]*@#\1:***@#' <<<"$1"
}

# The newest installed server's bin directory (/usr/lib/postgresql/<ver>/bin), if any.
_pg_server_bindir() {
    local d best=""
    for d in /usr/lib/postgresql/*/bin; do
        [[ -x $d/initdb && -x $d/pg_ctl && -x $d/postgres ]] || continue
        if [[ -z $best ]] || [[ "$(printf '%s\n%s\n' "$best" "$d" | sort -V | tail -n1)" == "$d" ]]; then
            best=$d
        fi
    done
    [[ -n $best ]] && printf '%s\n' "$best"
}

# psql that ignores ~/.psqlrc, never prompts, and gives up on connecting after 5 s.
_pg_psql() {
    local psql=psql bindir
    if ! command -v psql >/dev/null 2>&1; then
        bindir="$(_pg_server_bindir || true)"
        [[ -n $bindir && -x $bindir/psql ]] || die "psql not found (install postgresql-client)"
        psql=$bindir/psql
    fi
    PGCONNECT_TIMEOUT="${PGCONNECT_TIMEOUT:-5}" "$psql" -X -w -v ON_ERROR_STOP=1 "$@"
}

# _pg_can_create_db URL: connects, and the role may create databases.
_pg_can_create_db() {
    local out
    out="$(_pg_psql "$1" -Atqc 'select rolsuper or rolcreatedb from pg_roles where rolname = current_user' 2>/dev/null)" || return 1
    [[ $out == t ]]
}

_pg_apt_install() {
    ((EUID == 0)) || die "PostgreSQL is needed but '$*' is not installed, and installing it needs root: apt-get install -y $*"
    command -v apt-get >/dev/null 2>&1 || die "PostgreSQL is needed but '$*' is not installed and apt-get is unavailable"
    log "installing $* from Debian's packages (apt-get) ..."
    DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >/dev/null ||
        die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" </dev/null >/dev/null ||
        die "apt-get install $* failed"
}

# Run a command as the unprivileged owner of the throwaway cluster (postgres refuses root).
_pg_as_owner() {
    if ((EUID == 0)); then
        runuser -u "$_AL_PG_OWNER" -- "$@"
    else
        "$@"
    fi
}

_pg_choose_owner() {
    if ((EUID != 0)); then
        _AL_PG_OWNER="$(id -un)"
        return
    fi
    _AL_PG_OWNER=postgres
    if ! id -u postgres >/dev/null 2>&1; then
        useradd --system --home-dir /var/lib/postgresql --no-create-home --shell /usr/sbin/nologin postgres ||
            die "cannot create system user postgres for the throwaway cluster"
    fi
}

# --- the throwaway cluster --------------------------------------------------------------------

# Loads PG_PORT/PG_DATA/PG_SOCKDIR/PG_BINDIR from the state file; fails if there is none.
_pg_load_state() {
    _pg_paths
    local line key value
    PG_PORT="" PG_DATA="" PG_SOCKDIR="" PG_BINDIR=""
    [[ -r $_AL_PG_STATE ]] || return 1
    while IFS= read -r line; do
        key=${line%%=*}
        value=${line#*=}
        case $key in
            PG_PORT) PG_PORT=$value ;;
            PG_DATA) PG_DATA=$value ;;
            PG_SOCKDIR) PG_SOCKDIR=$value ;;
            PG_BINDIR) PG_BINDIR=$value ;;
        esac
    done <"$_AL_PG_STATE"
    [[ -n $PG_PORT && -n $PG_DATA && -n $PG_BINDIR ]]
}

_pg_save_state() {
    local pid=""
    [[ -r $PG_DATA/postmaster.pid ]] && pid="$(head -n1 "$PG_DATA/postmaster.pid" 2>/dev/null || true)"
    printf 'PG_PORT=%s\nPG_DATA=%s\nPG_SOCKDIR=%s\nPG_BINDIR=%s\nPG_PID=%s\n' \
        "$PG_PORT" "$PG_DATA" "$PG_SOCKDIR" "$PG_BINDIR" "$pid" >"$_AL_PG_STATE.tmp"
    mv -f "$_AL_PG_STATE.tmp" "$_AL_PG_STATE"
}

# The recorded cluster is running and answers on its port.
_pg_recorded_running() {
    _pg_load_state || return 1
    [[ -x $PG_BINDIR/pg_ctl && -d $PG_DATA ]] || return 1
    _pg_choose_owner
    _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1 || return 1
    _pg_psql "postgres://postgres@127.0.0.1:$PG_PORT/postgres" -Atqc 'select 1' >/dev/null 2>&1
}

_pg_start_throwaway() {
    local bindir port last log pidline logged
    bindir="$(_pg_server_bindir || true)"
    if [[ -z $bindir ]]; then
        _pg_apt_install postgresql
        bindir="$(_pg_server_bindir || true)"
        [[ -n $bindir ]] || die "installed postgresql but found no server binaries under /usr/lib/postgresql/*/bin"
    fi
    _pg_choose_owner

    mkdir -p "$_AL_PG_DIR"
    if ((EUID == 0)); then
        chown "$_AL_PG_OWNER" "$_AL_PG_DIR"
    fi
    if _pg_load_state && [[ -d $PG_DATA ]]; then
        : # restart the recorded cluster (its data dir may live under /tmp, see below)
    else
        PG_DATA="$_AL_PG_DIR/data"
        # The owner must reach the directory (a repository under /root is not traversable by
        # user postgres): fall back to a private directory under /tmp.
        if ! _pg_as_owner test -w "$_AL_PG_DIR" 2>/dev/null; then
            PG_DATA="$(mktemp -d /tmp/agentloop-pg.XXXXXX)/data"
            chown "$_AL_PG_OWNER" "$(dirname "$PG_DATA")"
        fi
        PG_PORT=""
    fi
    PG_BINDIR=$bindir
    PG_SOCKDIR="$(dirname "$PG_DATA")"
    # A unix socket path must stay under ~107 bytes.
    if ((${#PG_SOCKDIR} > 80)); then
        PG_SOCKDIR=/tmp
    fi

    if [[ ! -s $PG_DATA/PG_VERSION ]]; then
        rm -rf "$PG_DATA"
        mkdir -p "$PG_DATA"
        if ((EUID == 0)); then
            chown "$_AL_PG_OWNER" "$PG_DATA"
        fi
        chmod 700 "$PG_DATA"
        if ! _pg_as_owner "$bindir/initdb" -D "$PG_DATA" -U postgres -A trust -E UTF8 --no-locale \
            >"$(dirname "$PG_DATA")/initdb.log" 2>&1; then
            show_log_tail "$(dirname "$PG_DATA")/initdb.log"
            die "initdb failed for the throwaway cluster in $PG_DATA"
        fi
    elif [[ "$(cat "$PG_DATA/PG_VERSION")" != "$(basename "$(dirname "$bindir")")" ]]; then
        die "the throwaway cluster in $PG_DATA was made by PostgreSQL $(cat "$PG_DATA/PG_VERSION"), but the server binaries are $bindir; remove $(dirname "$PG_DATA") to start afresh"
    fi

    log="$(dirname "$PG_DATA")/postgres.log"
    port=${PG_PORT:-$AGENTLOOP_PG_FIRST_PORT}
    last=$((AGENTLOOP_PG_FIRST_PORT + 100))
    ((port < last)) || port=$AGENTLOOP_PG_FIRST_PORT
    while :; do
        if ((port >= last)); then
            die "no free port in $AGENTLOOP_PG_FIRST_PORT..$((last - 1)) for the throwaway cluster"
        fi
        if port_in_use 127.0.0.1 "$port" || [[ -e $PG_SOCKDIR/.s.PGSQL.$port ]]; then
            port=$((port + 1))
            continue
        fi
        logged=0
        [[ -r $log ]] && logged="$(wc -l <"$log")"
        # (subshell: the postmaster must not inherit the lock's descriptor)
        if (
            exec {_AL_PG_LOCKFD}>&-
            _pg_as_owner "$bindir/pg_ctl" -D "$PG_DATA" -l "$log" -w -t 60 -s \
                -o "-c listen_addresses=127.0.0.1 -p $port -k '$PG_SOCKDIR' -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" \
                start >/dev/null 2>&1
        ); then
            break
        fi
        # Lost a race for the port, or a real failure: the log tells which.
        if tail -n "+$((logged + 1))" "$log" 2>/dev/null |
            grep -qE 'Address already in use|could not bind|could not create any TCP/IP sockets|lock file .* already exists' &&
            ! _pg_as_owner "$bindir/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
            port=$((port + 1))
            continue
        fi
        show_log_tail "$log"
        die "could not start the throwaway PostgreSQL cluster in $PG_DATA (log: $log)"
    done
    PG_PORT=$port
    _pg_save_state
    pidline="$(head -n1 "$PG_DATA/postmaster.pid" 2>/dev/null || true)"
    log "started a throwaway PostgreSQL $(basename "$(dirname "$bindir")") on 127.0.0.1:$PG_PORT (pid $pidline, data $PG_DATA)"
}

# The lock serialises start/stop between concurrent scripts. Children started while it is held
# (the postmaster) must not inherit its descriptor, or the lock would live as long as they do.
_AL_PG_LOCKFD=""
_pg_lock() {
    mkdir -p "$_AL_PG_DIR"
    exec {_AL_PG_LOCKFD}>"$_AL_PG_DIR/lock"
    flock -w 120 "$_AL_PG_LOCKFD" || die "timed out waiting for the lock on $_AL_PG_DIR/lock"
}
_pg_unlock() {
    if [[ -n $_AL_PG_LOCKFD ]]; then
        exec {_AL_PG_LOCKFD}>&-
        _AL_PG_LOCKFD=""
    fi
}

# Scripts using the throwaway cluster register in $STACK_DIR/pg/users/<pid>, so that one of
# them stopping it never pulls it from under another: the last user out stops it instead.
_pg_register_user() {
    mkdir -p "$_AL_PG_DIR/users"
    write_pidfile "$_AL_PG_DIR/users/$$" "$$"
}
_pg_other_users() {
    local f pid
    for f in "$_AL_PG_DIR"/users/*; do
        [[ -e $f ]] || continue
        pid="$(pidfile_alive "$f")" || {
            rm -f "$f"
            continue
        }
        [[ $pid == "$$" ]] || printf '%s ' "$pid"
    done
}

# Exit hook of a script that used the throwaway cluster.
_pg_release() {
    _pg_paths
    rm -f "$_AL_PG_DIR/users/$$"
    if [[ ${AGENTLOOP_PG_STARTED:-0} == 1 || -e $_AL_PG_DIR/stop-when-idle ]]; then
        stop_throwaway_postgres
    fi
}

stop_throwaway_postgres() {
    _pg_paths
    _pg_load_state || return 0
    [[ -x $PG_BINDIR/pg_ctl && -d $PG_DATA ]] || return 0
    _pg_choose_owner
    _pg_lock
    local others
    others="$(_pg_other_users)"
    if [[ -n $others ]]; then
        : >"$_AL_PG_DIR/stop-when-idle"
        log "leaving the throwaway PostgreSQL on 127.0.0.1:$PG_PORT running: still used by pid ${others% } (the last one stops it)"
    elif _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
        if _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$PG_DATA" -m fast -w -t 30 -s stop >/dev/null 2>&1; then
            log "stopped the throwaway PostgreSQL on 127.0.0.1:$PG_PORT"
        else
            warn "could not stop the throwaway PostgreSQL in $PG_DATA; trying immediate mode"
            _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$PG_DATA" -m immediate -w -t 30 -s stop >/dev/null 2>&1 || true
        fi
        rm -f "$_AL_PG_DIR/stop-when-idle"
    else
        rm -f "$_AL_PG_DIR/stop-when-idle"
    fi
    _pg_unlock
    AGENTLOOP_PG_STARTED=0
}

# --- public -----------------------------------------------------------------------------------

ensure_postgres() {
    _pg_paths
    AGENTLOOP_PG_STARTED=0
    export AGENTLOOP_PG_STARTED

    # 1. Explicit URLs.
    if [[ -n ${PG_ADMIN_URL:-} ]]; then
        _pg_psql "$PG_ADMIN_URL" -Atqc 'select 1' >/dev/null ||
            die "PG_ADMIN_URL=$(_pg_redact "$PG_ADMIN_URL") does not accept connections"
        export PG_ADMIN_URL
        return 0
    fi
    if [[ -n ${DATABASE_URL:-} ]]; then
        # Its own database may not exist yet: fall back to the maintenance database `postgres`.
        local candidate
        for candidate in "$DATABASE_URL" "$(_pg_url_with_db "$DATABASE_URL" postgres)"; do
            if _pg_psql "$candidate" -Atqc 'select 1' >/dev/null 2>&1; then
                PG_ADMIN_URL=$candidate
                export PG_ADMIN_URL
                return 0
            fi
        done
        _pg_psql "$DATABASE_URL" -Atqc 'select 1' >/dev/null ||
            die "DATABASE_URL=$(_pg_redact "$DATABASE_URL") does not accept connections"
    fi

    # 2. The machine's server on 5432, trust auth for postgres.
    local default_url="postgres://postgres@127.0.0.1:5432/postgres"
    if [[ ${AGENTLOOP_FORCE_THROWAWAY_PG:-0} != 1 ]] && port_in_use 127.0.0.1 5432; then
        if ! command -v psql >/dev/null 2>&1 && [[ -z "$(_pg_server_bindir || true)" ]]; then
            _pg_apt_install postgresql-client
        fi
        if { ! command -v pg_isready >/dev/null 2>&1 || pg_isready -q -h 127.0.0.1 -p 5432 -t 5; } &&
            _pg_can_create_db "$default_url"; then
            PG_ADMIN_URL=$default_url
            export PG_ADMIN_URL
            return 0
        fi
    fi

    # 3. A throwaway cluster (shared by concurrent callers through a lock).
    _pg_lock
    if ! _pg_recorded_running; then
        _pg_start_throwaway
        AGENTLOOP_PG_STARTED=1
    fi
    if [[ ${AGENTLOOP_PG_KEEP_RUNNING:-0} != 1 ]]; then
        _pg_register_user
        rm -f "$_AL_PG_DIR/stop-when-idle" # somebody uses it again
        on_exit _pg_release
    fi
    _pg_unlock
    PG_ADMIN_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
    export PG_ADMIN_URL PG_PORT PG_DATA
    _pg_can_create_db "$PG_ADMIN_URL" ||
        die "the throwaway cluster on 127.0.0.1:$PG_PORT does not let postgres create databases"
}

ensure_database() {
    local name=${1:?ensure_database NAME}
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "ensure_database: unsupported database name '$name'"
    [[ -n ${PG_ADMIN_URL:-} ]] || ensure_postgres
    local exists
    exists="$(_pg_psql "$PG_ADMIN_URL" -Atqc "select 1 from pg_database where datname = '$name'")" ||
        die "cannot query databases on $(_pg_redact "$PG_ADMIN_URL")"
    if [[ $exists != 1 ]]; then
        # A concurrent creator may win the race; only a still-missing database is an error.
        if ! _pg_psql "$PG_ADMIN_URL" -qc "create database \"$name\"" >/dev/null 2>&1; then
            exists="$(_pg_psql "$PG_ADMIN_URL" -Atqc "select 1 from pg_database where datname = '$name'")" || true
            [[ $exists == 1 ]] || die "could not create database $name on $(_pg_redact "$PG_ADMIN_URL")"
        fi
    fi
    DATABASE_URL="$(_pg_url_with_db "$PG_ADMIN_URL" "$name")"
    export DATABASE_URL
}
