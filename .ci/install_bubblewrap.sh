#!/usr/bin/env bash
# Installs Debian's bubblewrap (bwrap) and util-linux's prlimit: the tool sandbox's "bwrap" backend
# (async_vapo/verify/tool_sandbox.py) and its attack tests (tests/integration/test_tool_sandbox.py), which must not
# skip in CI. Idempotent; needs root (CI runs as root) or passwordless sudo.
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
if command -v bwrap >/dev/null 2>&1 && command -v prlimit >/dev/null 2>&1; then
  exit 0
fi
apt_install install_bubblewrap bubblewrap util-linux
for bin in bwrap prlimit; do
  command -v "$bin" >/dev/null 2>&1 || { echo "install_bubblewrap: $bin not on PATH after install" >&2; exit 1; }
done
bwrap --version
