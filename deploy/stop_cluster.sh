#!/usr/bin/env bash
# Stop exactly what deploy/start_cluster.sh started in RUN_DIR: the process groups recorded in RUN_DIR/pids/*.pid
# (SIGTERM, then SIGKILL after cluster.stop_grace_s), plus the sandbox workers of the verifier and of rollout 0's
# evaluation pool (they run in their own sessions; listed in RUN_DIR/pids/*.children). Exits 0 only when nothing of them is left.
#
#   deploy/stop_cluster.sh RUN_DIR [--grace SECONDS]
set -uo pipefail
RUN_DIR=${1:?usage: deploy/stop_cluster.sh RUN_DIR [--grace SECONDS]}
PIDS="$RUN_DIR/pids"
GRACE=20
[ -f "$PIDS/cluster.env" ] && GRACE=$(sed -n 's/^STOP_GRACE=//p' "$PIDS/cluster.env")
[ "${2:-}" = "--grace" ] && GRACE=${3:?--grace needs seconds}
[ -d "$PIDS" ] || { echo "stop_cluster: no $PIDS: nothing was started there" >&2; exit 0; }

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
  while read -r pid; do
    [ -n "$pid" ] && grep -qa "async_vapo.verify.sandbox" "/proc/$pid/cmdline" 2>/dev/null && CHILDREN+=("$pid")
  done < "$f"
done

group_alive() { kill -0 -- "-$1" 2>/dev/null; }
signal_all() {  # signal_all SIG
  local name pid
  for name in "${LOCAL[@]}"; do
    pid=$(cat "$PIDS/$name.pid")
    group_alive "$pid" && kill -"$1" -- "-$pid" 2>/dev/null
  done
  for pid in "${CHILDREN[@]}"; do kill -"$1" "$pid" 2>/dev/null; done
  for name in "${REMOTE[@]}"; do
    ssh -o BatchMode=yes "$(cat "$PIDS/$name.host")" "kill -$1 -- -$(cat "$PIDS/$name.pid")" 2>/dev/null
  done
}
left() {  # prints what is still alive
  local name pid
  for name in "${LOCAL[@]}"; do
    pid=$(cat "$PIDS/$name.pid")
    group_alive "$pid" && echo "$name(pgid $pid)"
  done
  for pid in "${CHILDREN[@]}"; do kill -0 "$pid" 2>/dev/null && echo "sandbox-worker($pid)"; done
  for name in "${REMOTE[@]}"; do
    ssh -o BatchMode=yes "$(cat "$PIDS/$name.host")" "kill -0 -- -$(cat "$PIDS/$name.pid")" 2>/dev/null \
      && echo "$name@$(cat "$PIDS/$name.host")"
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
echo "stop_cluster: stopped ${#LOCAL[@]} local and ${#REMOTE[@]} remote process group(s) of $RUN_DIR" >&2
