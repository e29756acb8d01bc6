#!/usr/bin/env bash
# Installs Debian's OpenSSH server and client (used by tests/test_hostfile.py, which starts its own sshd on a
# loopback port to run deploy/start_cluster.sh --hostfile over real ssh). Idempotent; needs root (CI runs as
# root) or passwordless sudo. Starts and enables no server itself: the test runs its own sshd as a child.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have sshd && have ssh && have ssh-keygen; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install_sshd: need root or sudo" >&2; exit 1; }
  SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# In a container without an init system the package's post-install cannot start its service (policy-rc.d or no
# systemd); where it does start, it listens on :22, which the test does not use (it starts its own on a free port).
$SUDO apt-get install -y -qq --no-install-recommends openssh-server openssh-client
have sshd && have ssh && have ssh-keygen || { echo "install_sshd: sshd/ssh/ssh-keygen missing after install" >&2; exit 1; }
/usr/sbin/sshd -V 2>&1 | head -1 || ssh -V 2>&1 | head -1
