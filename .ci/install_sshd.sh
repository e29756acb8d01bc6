#!/usr/bin/env bash
# Installs Debian's OpenSSH server and client (used by tests/integration/test_hostfile.py, which starts its own sshd on a
# loopback port to run deploy/start_cluster.sh --hostfile over real ssh). Idempotent; needs root (CI runs as
# root) or passwordless sudo. Starts and enables no server itself: the test runs its own sshd as a child.
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have sshd && have ssh && have ssh-keygen; then
  exit 0
fi
apt_install install_sshd openssh-server openssh-client
have sshd && have ssh && have ssh-keygen || { echo "install_sshd: sshd/ssh/ssh-keygen missing after install" >&2; exit 1; }
ssh -V 2>&1 | head -1
