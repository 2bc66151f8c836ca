#!/usr/bin/env bash
# Installs the real Prometheus server (Debian package) for the metrics tests; idempotent.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a system service on install where it can; tests run their own instance.
(service prometheus stop || true) >/dev/null 2>&1
command -v prometheus
