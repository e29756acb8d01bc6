#!/usr/bin/env bash
# Installs Debian's `prometheus` server (used by tests/test_cluster.py's end-to-end test). Idempotent;
# needs root (CI runs as root) or passwordless sudo. Starts no server itself (the tests start their own).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install_prometheus: need root or sudo" >&2; exit 1; }
  SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# In a container without an init system the package's post-install cannot start its service; elsewhere the
# packaged service may start on :9090, which the tests do not use (they start their own on a free port).
$SUDO apt-get install -y -qq --no-install-recommends prometheus
command -v prometheus >/dev/null 2>&1 || { echo "install_prometheus: binary not on PATH after install" >&2; exit 1; }
prometheus --version 2>&1 | head -1
