#!/usr/bin/env bash
# Installs Debian's bubblewrap (bwrap), util-linux's prlimit and the system's python3 (the tool's interpreter: the
# sandbox's uid cannot reach one under a 0700 /root): the tool sandbox (async_vapo/verify/tool_sandbox.py) and its
# attack tests (tests/integration/test_tool_sandbox.py), which must not skip in CI. Idempotent; needs root (CI runs
# as root) or passwordless sudo.
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
have() { command -v bwrap >/dev/null 2>&1 && command -v prlimit >/dev/null 2>&1 && [ -x /usr/bin/python3 ]; }
if have; then
  exit 0
fi
apt_install install_bubblewrap bubblewrap util-linux python3
[ -x /usr/bin/python3 ] || { echo "install_bubblewrap: /usr/bin/python3 missing after install" >&2; exit 1; }
for bin in bwrap prlimit; do
  command -v "$bin" >/dev/null 2>&1 || { echo "install_bubblewrap: $bin not on PATH after install" >&2; exit 1; }
done
bwrap --version
