#!/usr/bin/env bash
# Installs Debian's `prometheus` server and its `promtool` (the end-to-end scrape tests; promtool checks and unit-tests
# deploy/prometheus/alerts.yml in tests/unit/test_dashboard.py). Idempotent;
# needs root (CI runs as root) or passwordless sudo. Starts no server itself (the tests start their own).
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
apt_install install_prometheus prometheus
for bin in prometheus promtool; do
  command -v "$bin" >/dev/null 2>&1 || { echo "install_prometheus: $bin not on PATH after install" >&2; exit 1; }
done
prometheus --version 2>&1 | head -1
