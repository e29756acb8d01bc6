#!/usr/bin/env bash
# Start the four async-vapo services (replay, verifier, rollout x async.rollout_devices, learner) and wait
# until each answers /health.
#
#   deploy/start_cluster.sh --config FILE [--config FILE2] [--run-dir DIR] [--hostfile FILE] [--resume CKPT|auto]
#                           [--prometheus] [--prometheus-port P] [--scrape-interval 5s] [--no-pin] [--wait]
#                           [-- key.sub=value ...]
#
# Every service runs as its own session/process group (setsid, nohup), appends its log to RUN_DIR/logs/<name>.log, and its
# PID (= its process-group id) is recorded in RUN_DIR/pids/<name>.pid; deploy/stop_cluster.sh RUN_DIR stops exactly
# those groups. RUN_DIR/prometheus/{targets.json,prometheus.yml} list what was started; --prometheus also runs a
# prometheus server on that config (when the binary exists). If a service is not healthy within
# cluster.health_timeout_s (or exits first), its log tail is printed, everything started is stopped, exit 1.
#
# Placement on one machine without GPUs: the cores are split between rollout engines and learner by the ratio
# async.rollout_devices : async.learner_devices (taskset; each engine gets its own slice when there are enough
# cores); replay and verifier are not pinned. --no-pin disables it. Learner ranks > 1 are launched with torchrun.
#
# --hostfile FILE: lines "host role" (role: replay, verifier, rollout, learner; several rollout lines spread the
# engines round-robin). Roles on other hosts are started over ssh (BatchMode, same repository path there); the
# services then bind 0.0.0.0 and connect to the hosts named here. --wait: block until the learner writes
# RUN_DIR/DONE (or exits), then stop the cluster.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
CONFIGS=() OVERRIDES=() RUN_DIR_ARG="" HOSTFILE="" RESUME="" PROM=0 PROM_PORT=9090 INTERVAL=5s PIN=1 WAIT=0
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIGS+=(--config "$(realpath "$2")"); shift 2 ;;
    --run-dir) RUN_DIR_ARG=$2; shift 2 ;;
    --hostfile) HOSTFILE=$2; shift 2 ;;
    --resume) RESUME=$2; shift 2 ;;
    --prometheus) PROM=1; shift ;;
    --prometheus-port) PROM_PORT=$2; shift 2 ;;
    --scrape-interval) INTERVAL=$2; shift 2 ;;
    --no-pin) PIN=0; shift ;;
    --wait) WAIT=1; shift ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "start_cluster: unknown argument $1" >&2; usage ;;
  esac
done
[ ${#CONFIGS[@]} -gt 0 ] || { echo "start_cluster: --config FILE is required" >&2; usage; }

# -- hostfile: role -> hosts, and the overrides that make services find each other -------------------------
declare -A ROLE_HOSTS=()
is_local() { case "$1" in localhost|127.0.0.1|"$(hostname)"|"$(hostname -f 2>/dev/null)") return 0 ;; esac; return 1; }
if [ -n "$HOSTFILE" ]; then
  while read -r host role _; do
    case "$host" in ''|'#'*) continue ;; esac
    case "$role" in replay|verifier|rollout|learner) ;; *) echo "start_cluster: bad role '$role' in $HOSTFILE" >&2; exit 2 ;; esac
    ROLE_HOSTS[$role]="${ROLE_HOSTS[$role]:-} $host"
  done < "$HOSTFILE"
  OVERRIDES+=(cluster.bind_host=0.0.0.0)
  for role in replay verifier learner; do
    h=$(echo ${ROLE_HOSTS[$role]:-localhost} | awk '{print $1}')
    is_local "$h" && h=127.0.0.1
    OVERRIDES+=("cluster.${role}_host=$h")
  done
  rh=()
  for h in ${ROLE_HOSTS[rollout]:-localhost}; do
    is_local "$h" && h=127.0.0.1
    rh+=("\"$h\"")
  done
  OVERRIDES+=("cluster.rollout_hosts=[$(IFS=,; echo "${rh[*]}")]")
fi
host_of() {  # host_of ROLE INDEX
  local hosts=(${ROLE_HOSTS[$1]:-localhost})
  echo "${hosts[$(( $2 % ${#hosts[@]} ))]}"
}

# -- plan: resolved config -> run dir, counts, health URLs; writes RUN_DIR/prometheus/* -----------------------
PLAN=$("$PY" -m async_vapo.cluster.common plan "${CONFIGS[@]}" ${RUN_DIR_ARG:+--run-dir "$RUN_DIR_ARG"} \
       --scrape-interval "$INTERVAL" -- "${OVERRIDES[@]}") || { echo "start_cluster: bad config" >&2; exit 2; }
eval "$PLAN"
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/pids"
for f in "$RUN_DIR"/pids/*.pid; do
  [ -e "$f" ] || continue
  if [ ! -e "$RUN_DIR/pids/$(basename "$f" .pid).host" ] && kill -0 -- "-$(cat "$f")" 2>/dev/null; then
    echo "start_cluster: $RUN_DIR already has a running cluster ($(basename "$f" .pid)); stop it first:" >&2
    echo "  deploy/stop_cluster.sh $RUN_DIR" >&2
    exit 1
  fi
done
rm -f "$RUN_DIR"/pids/* "$RUN_DIR/DONE"
ASYNC_VAPO_T0=$(date +%s.%N)
export ASYNC_VAPO_T0
echo "STOP_GRACE=$STOP_GRACE" > "$RUN_DIR/pids/cluster.env"
echo "[start_cluster] run dir $RUN_DIR: $N_ROLLOUT rollout engine(s), $N_LEARNER learner rank(s)" >&2

# -- the base model is built once here, not by four services at the same time -----------------------------------
if [ -z "$POLICY_PATH" ]; then
  "$PY" -m async_vapo.cli make-base "${CONFIGS[@]}" "${OVERRIDES[@]}" > "$RUN_DIR/logs/make-base.log" 2>&1 \
    || { echo "start_cluster: building the base model failed:" >&2; tail -n 30 "$RUN_DIR/logs/make-base.log" >&2; exit 1; }
fi

# -- placement -----------------------------------------------------------------------------------------------------
ROLLOUT_CPUS=() LEARNER_CPUS=""
ncpu=$(nproc)
if [ "$PIN" = 1 ] && [ -z "$HOSTFILE" ] && command -v taskset >/dev/null && ! command -v nvidia-smi >/dev/null \
   && [ "$ncpu" -ge 2 ]; then
  r=$(( ncpu * N_ROLLOUT / (N_ROLLOUT + N_LEARNER) ))
  [ "$r" -lt 1 ] && r=1
  [ "$r" -ge "$ncpu" ] && r=$(( ncpu - 1 ))
  LEARNER_CPUS="$r-$(( ncpu - 1 ))"
  for ((i = 0; i < N_ROLLOUT; i++)); do
    if [ "$r" -ge "$N_ROLLOUT" ]; then
      lo=$(( i * r / N_ROLLOUT )); hi=$(( (i + 1) * r / N_ROLLOUT - 1 ))
      ROLLOUT_CPUS+=("$lo-$hi")
    else
      ROLLOUT_CPUS+=("0-$(( r - 1 ))")
    fi
  done
fi

# -- start ---------------------------------------------------------------------------------------------------------
STARTED=()
start() {  # start NAME HOST CPUS CMD...
  local name=$1 host=$2 cpus=$3; shift 3
  local log="$RUN_DIR/logs/$name.log" pin=()
  [ -n "$cpus" ] && pin=(taskset -c "$cpus")
  if is_local "$host"; then
    if [ -n "$cpus" ]; then
      VLLM_CPU_OMP_THREADS_BIND="$cpus" setsid nohup "${pin[@]}" "$@" >> "$log" 2>&1 < /dev/null &
    else
      setsid nohup "$@" >> "$log" 2>&1 < /dev/null &
    fi
    echo $! > "$RUN_DIR/pids/$name.pid"
  else
    local q; q=$(printf '%q ' "$@")
    ssh -o BatchMode=yes "$host" "cd $(printf %q "$REPO") && mkdir -p $(printf %q "$RUN_DIR/logs") && \
      ASYNC_VAPO_T0=$ASYNC_VAPO_T0 setsid nohup $q >> $(printf %q "$log") 2>&1 < /dev/null & echo \$!" \
      > "$RUN_DIR/pids/$name.pid"
    echo "$host" > "$RUN_DIR/pids/$name.host"
  fi
  STARTED+=("$name")
}
svc_args=("${CONFIGS[@]}" --run-dir "$RUN_DIR")
start replay "$(host_of replay 0)" "" "$PY" "$REPO/services/replay.py" "${svc_args[@]}" -- "${OVERRIDES[@]}"
start verifier "$(host_of verifier 0)" "" "$PY" "$REPO/services/verifier.py" "${svc_args[@]}" -- "${OVERRIDES[@]}"
for ((i = 0; i < N_ROLLOUT; i++)); do
  start "rollout-$i" "$(host_of rollout "$i")" "${ROLLOUT_CPUS[$i]:-}" "$PY" "$REPO/services/rollout.py" \
    "${svc_args[@]}" --instance "$i" -- "${OVERRIDES[@]}"
done
learn_extra=()
[ -n "$RESUME" ] && learn_extra=(--resume "$RESUME")
if [ "$N_LEARNER" -gt 1 ]; then
  start learner "$(host_of learner 0)" "$LEARNER_CPUS" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$N_LEARNER" "$REPO/services/learner.py" "${svc_args[@]}" "${learn_extra[@]}" -- "${OVERRIDES[@]}"
else
  start learner "$(host_of learner 0)" "$LEARNER_CPUS" "$PY" "$REPO/services/learner.py" "${svc_args[@]}" \
    "${learn_extra[@]}" -- "${OVERRIDES[@]}"
fi
if [ "$PROM" = 1 ]; then
  if command -v prometheus >/dev/null; then
    setsid nohup prometheus --config.file="$RUN_DIR/prometheus/prometheus.yml" \
      --storage.tsdb.path="$RUN_DIR/prometheus/data" --web.listen-address="127.0.0.1:$PROM_PORT" \
      > "$RUN_DIR/logs/prometheus.log" 2>&1 < /dev/null &
    echo $! > "$RUN_DIR/pids/prometheus.pid"
    echo "[start_cluster] prometheus on http://127.0.0.1:$PROM_PORT" >&2
  else
    echo "[start_cluster] --prometheus: no prometheus binary on PATH (.ci/install_prometheus.sh); skipped" >&2
  fi
fi

# -- health --------------------------------------------------------------------------------------------------------
health_url() {  # health_url NAME -> the plan's URL (on the role's host)
  local name=$1 role=${1%%-*} idx=0 var
  [ "$name" != "$role" ] && idx=${name##*-}
  var="HEALTH_${role^^}_${idx}"
  echo "${!var}"
}
for name in "${STARTED[@]}"; do
  pid_arg=()
  [ -e "$RUN_DIR/pids/$name.host" ] || pid_arg=("$(cat "$RUN_DIR/pids/$name.pid")")
  if ! "$PY" -m async_vapo.cluster.common wait-health "$(health_url "$name")" "$HEALTH_TIMEOUT" "${pid_arg[@]}"; then
    echo "[start_cluster] $name did not become healthy; last lines of $RUN_DIR/logs/$name.log:" >&2
    tail -n 40 "$RUN_DIR/logs/$name.log" >&2 || true
    "$REPO/deploy/stop_cluster.sh" "$RUN_DIR" >&2 || true
    exit 1
  fi
  echo "[start_cluster] $name healthy ($(health_url "$name"))" >&2
done
echo "[start_cluster] all services up; logs in $RUN_DIR/logs; stop with: deploy/stop_cluster.sh $RUN_DIR" >&2

if [ "$WAIT" = 1 ]; then
  learner_pid=$(cat "$RUN_DIR/pids/learner.pid")
  while [ ! -e "$RUN_DIR/DONE" ] && kill -0 "$learner_pid" 2>/dev/null; do sleep 2; done
  # rollout 0 evaluates the last version once it has loaded it: give it up to 2 minutes (when it evaluates at all)
  if [ -e "$RUN_DIR/DONE" ] && grep -q '"kind": "eval"' "$RUN_DIR/metrics.jsonl" 2>/dev/null; then
    last=$(cat "$RUN_DIR/DONE")
    for _ in $(seq 60); do
      grep -q "\"kind\": \"eval\", \"step\": $last," "$RUN_DIR/metrics.jsonl" && break
      sleep 2
    done
  fi
  "$REPO/deploy/stop_cluster.sh" "$RUN_DIR"
  [ -e "$RUN_DIR/DONE" ] || { echo "[start_cluster] the learner exited before finishing" >&2; exit 1; }
fi
