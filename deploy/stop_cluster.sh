#!/usr/bin/env bash
# Stop exactly what deploy/start_cluster.sh started in RUN_DIR. First the supervisors (RUN_DIR/supervisor/hosts lists
# them, one per host): SIGTERM makes each stop its services (SIGTERM to every process group, SIGKILL after
# cluster.deploy.stop_grace_s) and exit, so nothing is restarted from then on; one still running after the grace and
# 15 s more is SIGKILLed. Then the process groups recorded in RUN_DIR/pids/*.pid (a service's launcher rewrites its
# file at every start), with SIGTERM, then SIGKILL after the grace, plus the sandbox workers of the verifier and of
# rollout 0's evaluation pool (they run in their own sessions; listed in RUN_DIR/pids/*.children). Exits 0 only when
# nothing of them is left. Services started over ssh (RUN_DIR/pids/NAME.host names the host) are signalled and
# checked there (their PID read from that host's RUN_DIR/pids/NAME.pid), their sandbox
# workers too (from that host's RUN_DIR/pids/NAME.children), with the ssh command start_cluster.sh recorded in
# RUN_DIR/pids/cluster.env (ASYNC_VAPO_SSH set in the environment wins; default "ssh -o BatchMode=yes"); a host
# that cannot be reached counts as not stopped.
#
#   deploy/stop_cluster.sh RUN_DIR [--grace SECONDS]
set -uo pipefail
RUN_DIR=${1:?usage: deploy/stop_cluster.sh RUN_DIR [--grace SECONDS]}
PIDS="$RUN_DIR/pids"
GRACE=20
[ -f "$PIDS/cluster.env" ] && GRACE=$(sed -n 's/^STOP_GRACE=//p' "$PIDS/cluster.env")
[ "${2:-}" = "--grace" ] && GRACE=${3:?--grace needs seconds}
[ -d "$PIDS" ] || { echo "stop_cluster: no $PIDS: nothing was started there" >&2; exit 0; }
SSH_CMD=${ASYNC_VAPO_SSH:-}
[ -z "$SSH_CMD" ] && [ -f "$PIDS/cluster.env" ] && SSH_CMD=$(sed -n 's/^ASYNC_VAPO_SSH=//p' "$PIDS/cluster.env")
read -ra SSH <<< "${SSH_CMD:-ssh -o BatchMode=yes}"
ABS_PIDS=$(cd "$PIDS" && pwd -P)  # the remote shell starts in its home directory
q() { local s=$1; printf "'%s'" "${s//\'/\'\\\'\'}"; }  # one word, single-quoted for the remote shell

# -- the supervisors first ---------------------------------------------------------------------------------------
SUP="$RUN_DIR/supervisor"
ABS_SUP=$( (cd "$SUP" 2>/dev/null && pwd -P) || echo "$SUP")
sup_do() {  # sup_do TAG HOST SIG: signal TAG's supervisord on HOST ("-": here); exit 1 when it does not run
  local script  # only a PID that still runs supervisord on this config (a PID reused by anything else is left alone)
  script="p=\$(cat $(q "$ABS_SUP/$1.pid") 2>/dev/null) && tr '\\0' ' ' < /proc/\$p/cmdline 2>/dev/null \
| grep -qF $(q "$ABS_SUP/$1.conf") && kill -$3 \$p"
  if [ "$2" = - ]; then bash -c "$script"; else "${SSH[@]}" "$2" "bash -c $(q "$script")" < /dev/null 2>/dev/null; fi
}
SUPS=()
[ -f "$SUP/hosts" ] && while read -r tag host; do SUPS+=("$tag $host"); done < "$SUP/hosts"
sups_left() {  # prints the supervisors still running (or that cannot be checked)
  local s rc
  for s in "${SUPS[@]}"; do
    rc=0; sup_do $s 0 || rc=$?
    [ "$rc" = 1 ] || echo "supervisord(${s% *}@${s#* })"
  done
}
if [ ${#SUPS[@]} -gt 0 ]; then
  for s in "${SUPS[@]}"; do sup_do $s TERM; done
  deadline=$(( $(date +%s) + GRACE + 15 ))
  while [ -n "$(sups_left)" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
  if [ -n "$(sups_left)" ]; then
    echo "stop_cluster: supervisor(s) still running, SIGKILL: $(sups_left | tr '\n' ' ')" >&2
    for s in "${SUPS[@]}"; do sup_do $s KILL; done
  fi
fi

# -- then every service's process group and sandbox workers --------------------------------------------------------
LOCAL=() REMOTE=()
for f in "$PIDS"/*.pid; do
  [ -e "$f" ] || continue
  name=$(basename "$f" .pid)
  if [ -e "$PIDS/$name.host" ]; then REMOTE+=("$name"); else LOCAL+=("$name"); fi
done
# sandbox workers: only PIDs that still run the sandbox (a PID reused by something else is left alone)
CHILDREN=()
for f in "$PIDS"/*.children; do
  [ -e "$f" ] || continue
  [ -e "$PIDS/$(basename "$f" .children).host" ] && continue  # a remote service's: handled on its host
  while read -r pid; do
    [ -n "$pid" ] && grep -qa "async_vapo.verify.sandbox" "/proc/$pid/cmdline" 2>/dev/null && CHILDREN+=("$pid")
  done < "$f"
done

group_alive() { kill -0 -- "-$1" 2>/dev/null; }
remote_do() {  # remote_do NAME SIG: signal NAME's group and sandbox workers on its host; SIG 0: print what is alive
  local pf cf
  pf=$(q "$ABS_PIDS/$1.pid") cf=$(q "$ABS_PIDS/$1.children")
  "${SSH[@]}" "$(cat "$PIDS/$1.host")" "bash -c $(q "
    pgid=\$(cat $pf) || exit 0
    if [ $2 = 0 ]; then kill -0 -- -\$pgid 2>/dev/null && echo \"pgid \$pgid\"; else kill -$2 -- -\$pgid 2>/dev/null; fi
    [ -f $cf ] || exit 0
    for p in \$(cat $cf); do
      grep -qa async_vapo.verify.sandbox /proc/\$p/cmdline 2>/dev/null || continue
      if [ $2 = 0 ]; then echo \"sandbox-worker \$p\"; else kill -$2 \$p 2>/dev/null; fi
    done
    exit 0")" < /dev/null 2>/dev/null
}
signal_all() {  # signal_all SIG
  local name pid
  for name in "${LOCAL[@]}"; do
    pid=$(cat "$PIDS/$name.pid")
    group_alive "$pid" && kill -"$1" -- "-$pid" 2>/dev/null
  done
  for pid in "${CHILDREN[@]}"; do kill -"$1" "$pid" 2>/dev/null; done
  for name in "${REMOTE[@]}"; do remote_do "$name" "$1"; done
}
left() {  # prints what is still alive
  local name pid
  for name in "${LOCAL[@]}"; do
    pid=$(cat "$PIDS/$name.pid")
    group_alive "$pid" && echo "$name(pgid $pid)"
  done
  for pid in "${CHILDREN[@]}"; do kill -0 "$pid" 2>/dev/null && echo "sandbox-worker($pid)"; done
  local out
  for name in "${REMOTE[@]}"; do
    if out=$(remote_do "$name" 0); then
      [ -n "$out" ] && echo "$name@$(cat "$PIDS/$name.host")($(echo "$out" | paste -sd, -))"
    else
      echo "$name@$(cat "$PIDS/$name.host")(ssh failed)"
    fi
  done
}

# Every group at once: services end their loop on SIGTERM within a poll period (plus the step in progress).
signal_all TERM
deadline=$(( $(date +%s) + GRACE ))
while [ -n "$(left)" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
if [ -n "$(left)" ]; then
  echo "stop_cluster: still running after ${GRACE}s, SIGKILL: $(left | tr '\n' ' ')" >&2
  signal_all KILL
  deadline=$(( $(date +%s) + 15 ))  # a killed process with GiBs of memory can take seconds to be reaped
  while [ -n "$(left)" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
fi
rest=$(left)
if [ -n "$rest" ]; then
  echo "stop_cluster: could not stop: $(echo "$rest" | tr '\n' ' ')" >&2
  exit 1
fi
rest=$(sups_left)
if [ -n "$rest" ]; then
  echo "stop_cluster: could not stop: $(echo "$rest" | tr '\n' ' ')" >&2
  exit 1
fi
echo "stop_cluster: stopped ${#LOCAL[@]} local and ${#REMOTE[@]} remote process group(s) of $RUN_DIR" >&2
