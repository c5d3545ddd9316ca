#!/usr/bin/env bash
# PostgreSQL server binaries for `make test-postgres` (the suite starts its own throwaway cluster on
# 127.0.0.1 in a temp dir; nothing here starts or configures a system service).
# Installed through apt when running as root and missing; otherwise say what to install.
set -euo pipefail
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "installing system package: postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends postgresql >/dev/null
    # The package starts a cluster on port 5432 through the init system when it can; the tests do not use it.
else
    echo "ERROR: PostgreSQL server binaries (initdb, pg_ctl) not found; install the 'postgresql' package as root" >&2
    exit 1
fi
