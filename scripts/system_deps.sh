#!/usr/bin/env bash
# System packages the project needs: bubblewrap (code sandbox) and Chromium (browser test).
# Installed through apt when running as root and missing; otherwise say what is missing.
set -euo pipefail
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "WARNING: missing system packages ${missing[*]} (install them with apt as root)" >&2
fi
