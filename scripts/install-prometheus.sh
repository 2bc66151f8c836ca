#!/usr/bin/env bash
# Installs the real Prometheus server (Debian package) for the metrics tests; idempotent.
# Without apt-get it only warns: tests/test_metrics_prometheus.py then skips with that reason.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-prometheus: no apt-get here; install a prometheus binary on PATH or the Prometheus tests skip" >&2
  exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo -n); fi
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a system service on install where it can; tests run their own instance.
("${SUDO[@]}" service prometheus stop || true) >/dev/null 2>&1
command -v prometheus
