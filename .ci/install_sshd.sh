#!/usr/bin/env bash
# Installs Debian's OpenSSH server and client and iproute2 (used by tests/integration/test_hosts.py, which makes its own
# hosts as network namespaces, each running its own sshd, to run deploy/start_cluster.sh --hostfile over real ssh). Idempotent; needs root (CI runs as
# root) or passwordless sudo. Starts and enables no server itself: the test runs its own sshd as a child.
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have sshd && have ssh && have ssh-keygen && have ip; then
  exit 0
fi
apt_install install_sshd openssh-server openssh-client iproute2
have sshd && have ssh && have ssh-keygen && have ip || {
  echo "install_sshd: sshd/ssh/ssh-keygen/ip missing after install" >&2; exit 1; }
ssh -V 2>&1 | head -1
