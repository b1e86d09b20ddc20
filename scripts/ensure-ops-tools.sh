#!/usr/bin/env bash
# Install the operations tools the metrics and alert tests run against, when they are missing:
# Debian's prometheus-pushgateway (/usr/bin/prometheus-pushgateway) and prometheus (/usr/bin/promtool),
# chromium (/usr/bin/chromium, with a font) for the headless screenshot of the Prefect run page, and
# mariadb-server (/usr/sbin/mariadbd, mariadb-install-db) for the MySQL / MariaDB tests when no MariaDB
# answers on 127.0.0.1:3306 (tests/mariadb_server.py starts its own then), and
# pgbouncer (/usr/sbin/pgbouncer) for the drain's test behind a transaction pooler.
# Idempotent and quiet: does nothing when all of them are already installed. Needs root (or sudo)
# on Debian/Ubuntu; never starts a service (the tests start their own Pushgateway on loopback).
set -euo pipefail

missing=()
command -v prometheus-pushgateway >/dev/null 2>&1 || missing+=(prometheus-pushgateway)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-dejavu-core)
# /usr/sbin is not on every user's PATH: look there too.
{ command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ]; } || missing+=(mariadb-server)
{ command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; } || missing+=(pgbouncer)
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo)
else
    echo "ensure-ops-tools: need root to install ${missing[*]} (apt-get)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-ops-tools: apt-get not found; install ${missing[*]} by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# A package's postinst must not start the daemons on a CI machine: policy-rc.d exit 101 forbids
# it for the duration of the install only (left alone when the machine already has one).
policy=/usr/sbin/policy-rc.d
added_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
    "${as_root[@]}" chmod 0755 "$policy"
    added_policy=1
fi
cleanup() {
    if [ "$added_policy" -eq 1 ]; then
        "${as_root[@]}" rm -f "$policy"
    fi
}
trap cleanup EXIT

# Quiet on success; on failure, apt's own output says why.
apt_log=$(mktemp)
if ! { "${as_root[@]}" apt-get update -qq && \
       "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$apt_log" 2>&1; then
    cat "$apt_log" >&2
    rm -f "$apt_log"
    echo "ensure-ops-tools: apt-get could not install ${missing[*]}" >&2
    exit 1
fi
rm -f "$apt_log"

for tool in prometheus-pushgateway promtool chromium mariadb-install-db; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "ensure-ops-tools: $tool still missing after apt-get install" >&2
        exit 1
    fi
done
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
    echo "ensure-ops-tools: pgbouncer still missing after apt-get install" >&2
    exit 1
fi
