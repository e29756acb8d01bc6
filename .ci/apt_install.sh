# Sourced by .ci/install_*.sh: apt_install NAME PACKAGE... installs Debian packages as root or with
# passwordless sudo, non-interactively, without recommends. In a container without an init system a package's
# post-install cannot start its service; elsewhere it may (prometheus on :9090, sshd on :22): the tests do not
# use those, they start their own servers on free ports.
apt_install() {
  local name=$1 sudo=""
  shift
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "$name: need root or sudo" >&2; return 1; }
    sudo="sudo -n"
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@"
}
