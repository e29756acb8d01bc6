#!/usr/bin/env bash
# Installs Debian's `prometheus` server (used by tests/integration/test_cluster.py's end-to-end test). Idempotent;
# needs root (CI runs as root) or passwordless sudo. Starts no server itself (the tests start their own).
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
apt_install install_prometheus prometheus
command -v prometheus >/dev/null 2>&1 || { echo "install_prometheus: binary not on PATH after install" >&2; exit 1; }
prometheus --version 2>&1 | head -1
