#!/usr/bin/env bash
# Start the four async-vapo services (replay, verifier, rollout x async.rollout_devices, learner) and wait
# until each answers /health.
#
#   deploy/start_cluster.sh --config FILE [options] [key.sub=value ...]
#
# Overrides (key.sub=value) may stand anywhere on the line, as async-vapo takes them; after "--" every word is one.
#
#   --config FILE          a TOML config (repeat to layer several, left to right, as async-vapo --config)
#   --run-dir DIR          write the run to DIR instead of the config's train.output_dir (runs/NAME)
#   --resume CKPT|auto     continue from this checkpoint (RUN_DIR/checkpoints/step_N), or 'auto': from the run
#                          directory's newest (an error if it cannot be continued)
#   --new-run              start a new run in a directory that holds none (DIR-2, DIR-3, ...)
#   --wait                 stay until the learner writes RUN_DIR/DONE (its progress shown every 10 s), then stop the
#                          cluster and exit 0 (1 if the learner stopped first); without --wait the script returns as
#                          soon as every service is healthy and the cluster runs on (deploy/stop_cluster.sh RUN_DIR)
#   --hostfile FILE        'host role' lines (role: replay, verifier, rollout, learner): each role on its host(s), those
#                          on other machines over ssh (ASYNC_VAPO_SSH); without it every service runs on this machine
#   --gpus-per-host N      GPUs of every host for the placement (default: nvidia-smi's count here, 0 without one)
#   --no-pin               no CPU pinning (one machine without GPUs) and no GPU placement
#   --prometheus           also run a Prometheus server on RUN_DIR/prometheus/prometheus.yml, scraping every service,
#                          with the alert rules of deploy/prometheus/ (when a prometheus binary is on PATH)
#   --prometheus-port P    its port on 127.0.0.1 (default 9090)
#   --scrape-interval T    its scrape interval (default 5s)
#   --dry-run              print the plan (host, GPUs or cores and command of every process) that a start would run,
#                          then exit: nothing is started or written (with GPUs also plan's memory check, exit 1 when
#                          it does not fit); the check of --no-check is not run
#   --no-check             skip `async-vapo check` (data files, answer format, model, ports, disk space), which runs
#                          first otherwise: a problem it finds stops the start before anything is started
#   -h, --help             this text
#
# Environment: PYTHON (default REPO/.venv/bin/python), ASYNC_VAPO_SSH (the ssh command of --hostfile's remote hosts),
# ASYNC_VAPO_GPU_MEMORY_GIB (GPU memory of the dry run's memory check, default 80). `make cluster` runs this script
# with --wait on CONFIG (default configs/tiny_cpu.toml); `PROMETHEUS=1 make cluster` adds --prometheus.
# -----
# The run directory (the config's train.output_dir, or --run-dir) follows async_vapo.learner.rundir's rule, and the
# plan says which on the terminal: a run there that can be continued (same config, a checkpoint, not finished)
# resumes from its newest checkpoint; a finished run, or one of another config, is kept and the run goes to DIR-2
# (DIR-3, ...). --new-run always takes a directory that holds no run; --resume auto resumes or fails.
# The base model and the reward-like critic come from the model cache, else from the package's shipped builds
# (checked against their SHA-256 manifest), else they are built here, with the progress on the terminal.
#
# Supervision: one supervisord per host (RUN_DIR/supervisor/<tag>.conf, tag "local" or the host's name; its pidfile
# and socket there too) runs that host's services, each in a process group of its own, and restarts one that dies:
# after cluster.deploy.restart_backoff_s, doubling per crash, and not again after more than
# cluster.deploy.crash_loop_max_restarts crashes within cluster.deploy.crash_loop_window_s
# (async_vapo.deploy.crashloop; it writes RUN_DIR/supervisor/<name>.gave_up). A restarted learner resumes from the
# newest checkpoint of this run.
# Each service appends its log to RUN_DIR/logs/<name>.log, and its PID (= its process-group id) is rewritten to
# RUN_DIR/pids/<name>.pid at every start; deploy/stop_cluster.sh RUN_DIR stops the supervisors, then makes sure none
# of those groups is left. `python -m async_vapo.deploy.supervise status RUN_DIR` shows states, starts, decisions.
# RUN_DIR/prometheus/{targets.json,prometheus.yml} list what was started; --prometheus also runs a prometheus server
# on that config (when the binary exists), supervised too. If a service is not healthy within
# cluster.deploy.health_timeout_s (or its first process exits first), its log tail is printed, everything started is
# stopped, exit 1.
#
# Placement with GPUs (async_vapo/deploy/placement.py): async.rollout_devices GPUs go to engines of
# rollout.tensor_parallel_size GPUs each, async.learner_devices GPUs to the learner's ranks (one torchrun per learner
# host, the ranks split evenly, each on its host's lowest GPUs); each process gets its CUDA_VISIBLE_DEVICES, several
# engines may share a host.
# --gpus-per-host N gives the GPUs of every host (default: nvidia-smi's count on this machine, 0 without it; hosts
# are taken to be alike). A shape that does not fit is refused before anything starts.
# Placement on one machine without GPUs: the cores are split between rollout engines and learner by the ratio
# async.rollout_devices : async.learner_devices (taskset; each engine gets its own slice when there are enough
# cores); replay and verifier are not pinned. With cluster.deploy.lend_cpus = true and one learner rank the
# engines lend theirs: the learner may run on every core, with its share as train.threads, and takes every core while
# all engines wait for a version; one engine with continuous generation runs on every core too, with its share as
# cluster.rollout.engine_threads, and takes every core while the learner waits for a batch. --no-pin disables both. Learner ranks > 1 are launched with torchrun.
# --dry-run: print the plan (host, CUDA_VISIBLE_DEVICES or cores, command of every process) and exit; nothing is
# started or written. With GPUs it also runs `async-vapo plan`'s memory check of that placement (per learner rank
# and engine GPU, GPUs of ASYNC_VAPO_GPU_MEMORY_GIB, default 80) and exits 1 when something does not fit.
#
# --hostfile FILE: lines "host role" (role: replay, verifier, rollout, learner; several rollout lines spread the
# engines round-robin). Roles on other hosts (not localhost, 127.0.0.1 or this machine's name) are started over ssh,
# with the same repository, python ($PYTHON, default REPO/.venv/bin/python) and RUN_DIR paths there: one ssh call
# per host writes that host's supervisor config and launchers into RUN_DIR/supervisor/ there and runs
# `env ... PYTHON -m supervisor.supervisord -c RUN_DIR/supervisor/<tag>.conf`, with the environment ASYNC_VAPO_T0,
# PYTHONPATH=REPO[:$PYTHONPATH] and this shell's ASYNC_VAPO_*, VLLM_*, HF_*, TRANSFORMERS_*, TORCH_*, NCCL_*, GLOO_*,
# OMP_NUM_THREADS, MKL_NUM_THREADS, CUDA_VISIBLE_DEVICES, TOKENIZERS_PARALLELISM. Each service's PID there (= its
# process-group id) is copied to RUN_DIR/pids/NAME.pid here and the host to NAME.host; health is polled at
# http(s)://HOST:PORT/health from here while the process is checked over ssh. The services then bind 0.0.0.0 and
# connect to the hosts named here; roles on this machine are announced to the others as ASYNC_VAPO_ADVERTISE_HOST
# (default: this machine's source address towards the first remote host; 127.0.0.1 when every role is local). The
# base model must be visible at the same path on every host (shared file system); engines on other hosts than the
# learner's fetch new weights over ZeroMQ (cluster.weights.transfer "auto").
#   ASYNC_VAPO_SSH: the ssh command of every remote call (start, liveness checks, log tails, stop), split on
#   whitespace; default "ssh -o BatchMode=yes". E.g. ASYNC_VAPO_SSH="ssh -o BatchMode=yes -p 2222 -i KEY" or
#   "ssh -F my_ssh_config". It is recorded in RUN_DIR/pids/cluster.env, so deploy/stop_cluster.sh uses the same one.
# Learner on several hosts (several "HOST learner" lines): one torchrun agent per learner host, the service "learner"
# on the first (node rank 0: global rank 0, which does all of the learner's I/O and alone writes metrics.jsonl,
# checkpoints' learner_state.pt, summary.json and DONE) and "learner-I" on the I-th, each
#   torchrun --nnodes H --node-rank I --nproc-per-node K --rdzv-backend c10d --rdzv-id RUN_ID
#            --rdzv-endpoint FIRST:cluster.ports.learner_rdzv_port --local-addr HOST --max-restarts 0
# (FIRST and HOST as the hostfile names them, this machine's as the address announced to the others; the first
# agent hosts the rendezvous store). async.learner_devices = H x K (an uneven split is refused, --dry-run too); gloo
# on CPU hosts, NCCL on GPUs. c10d numbers agents by address, not by --node-rank, so every rank takes global rank
# I x K + local rank itself (async_vapo.services.learner --node-rank). RUN_DIR must be on a file system the learner hosts
# share: every rank writes its shards of each checkpoint there. When one agent or rank dies, the group re-forms and
# continues from the run's newest checkpoint: the dead agent's supervisord restarts it like any service (backoff,
# crash-loop limit; a torchrun agent's ranks die with it); its arrival at the rendezvous makes the surviving agents
# restart their ranks (torchrun's membership change), and a surviving agent whose ranks failed on the lost peer
# (at once with gloo, after learner.dist_timeout_s with NCCL) exits and is restarted by its own supervisord. Every
# learner rank, however restarted, resumes from the newest checkpoint written since this start (rank 0 decides:
# --resume-since RUN_DIR/supervisor/TAG.conf), else from the one the cluster started with; the updates after that
# checkpoint are made again. --wait ends when any learner agent is given up.
# --wait: block until the learner writes RUN_DIR/DONE (or exits), then stop the cluster.
# Held-out evaluation outside the training engines (cluster.evaluator.mode, async-vapo eval RUN_DIR): "watch" starts a
# fifth supervised process, evaluator, on the first learner host (with GPUs: rollout.tensor_parallel_size GPUs no
# service uses), which evaluates each checkpoint as it is written, and --wait waits for it to finish the last (its
# RUN_DIR/eval/DONE); "after" needs --wait and evaluates every checkpoint once the services are stopped, with the whole
# machine. Its rows are eval rows of RUN_DIR/metrics.jsonl ("source": "checkpoint"), its log RUN_DIR/logs/evaluator.log.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
CONFIGS=() OVERRIDES=() RUN_DIR_ARG="" HOSTFILE="" RESUME="" NEW_RUN=0 PROM=0 PROM_PORT=9090 INTERVAL=5s PIN=1 WAIT=0
GPUS_PER_HOST="" DRY_RUN=0 CHECK=1
help_text() { sed -n '2,/^# -----$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
usage() { help_text >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --config|--run-dir|--hostfile|--resume|--prometheus-port|--scrape-interval|--gpus-per-host)
      [ $# -ge 2 ] || { echo "start_cluster: $1 needs a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --config) CONFIGS+=(--config "$(realpath "$2")"); shift 2 ;;
    --run-dir) RUN_DIR_ARG=$2; shift 2 ;;
    --hostfile) HOSTFILE=$2; shift 2 ;;
    --resume) RESUME=$2; shift 2 ;;
    --new-run) NEW_RUN=1; shift ;;
    --prometheus) PROM=1; shift ;;
    --prometheus-port) PROM_PORT=$2; shift 2 ;;
    --scrape-interval) INTERVAL=$2; shift 2 ;;
    --no-pin) PIN=0; shift ;;
    --wait) WAIT=1; shift ;;
    --gpus-per-host) GPUS_PER_HOST=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --no-check) CHECK=0; shift ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -h|--help) help_text; exit 0 ;;
    -*) echo "start_cluster: unknown argument $1 (the options: --help)" >&2; exit 2 ;;
    *=*) OVERRIDES+=("$1"); shift ;;  # an override, anywhere on the line
    *) echo "start_cluster: unknown argument $1 (an override is key.sub=value; the options: --help)" >&2; exit 2 ;;
  esac
done
[ ${#CONFIGS[@]} -gt 0 ] || { echo "start_cluster: --config FILE is required" >&2; usage; }

# -- hostfile: role -> hosts, and the overrides that make services find each other -------------------------
declare -A ROLE_HOSTS=()
is_local() {
  case "$1" in localhost|127.0.0.1|"$(hostname)"|"$(hostname -f 2>/dev/null)"|"$(hostname -s 2>/dev/null)") return 0 ;; esac
  return 1
}
SSH_CMD=${ASYNC_VAPO_SSH:-ssh -o BatchMode=yes}
read -ra SSH <<< "$SSH_CMD"
q() { local s=$1; printf "'%s'" "${s//\'/\'\\\'\'}"; }  # one word, single-quoted for the remote shell
remote() {  # remote HOST SCRIPT: run SCRIPT with bash on HOST (stdin closed: never eats a caller's input)
  "${SSH[@]}" "$1" "bash -c $(q "$2")" < /dev/null
}
if [ -n "$HOSTFILE" ]; then
  while read -r host role _; do
    case "$host" in ''|'#'*) continue ;; esac
    case "$role" in replay|verifier|rollout|learner) ;; *) echo "start_cluster: bad role '$role' in $HOSTFILE" >&2; exit 2 ;; esac
    ROLE_HOSTS[$role]="${ROLE_HOSTS[$role]:-} $host"
  done < "$HOSTFILE"
  # Roles on this machine are announced under an address the remote hosts reach it at (not 127.0.0.1).
  LOCAL_ADDR=127.0.0.1 first_remote=""
  for role in replay verifier rollout learner; do
    for h in ${ROLE_HOSTS[$role]:-}; do is_local "$h" || first_remote=${first_remote:-$h}; done
  done
  if [ -n "$first_remote" ]; then
    LOCAL_ADDR=${ASYNC_VAPO_ADVERTISE_HOST:-$("$PY" -c 'import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9))  # UDP: picks the route, sends nothing
print(s.getsockname()[0])' "$first_remote" 2>/dev/null || hostname -f 2>/dev/null || hostname)}
  fi
  OVERRIDES+=(cluster.hosts.bind_host=0.0.0.0)
  for role in replay verifier learner; do
    h=$(echo ${ROLE_HOSTS[$role]:-localhost} | awk '{print $1}')
    is_local "$h" && h=$LOCAL_ADDR
    OVERRIDES+=("cluster.hosts.${role}_host=$h")
  done
  # the engines' hosts (cluster.hosts.rollout_hosts) come from the placement below
fi
if [ -z "$GPUS_PER_HOST" ]; then
  GPUS_PER_HOST=0
  if command -v nvidia-smi >/dev/null; then GPUS_PER_HOST=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
fi
[[ $GPUS_PER_HOST =~ ^[0-9]+$ ]] || { echo "start_cluster: --gpus-per-host must be a count, got '$GPUS_PER_HOST'" >&2; exit 2; }
[ "$PIN" = 1 ] || GPUS_PER_HOST=0
host_of() {  # host_of NAME: the host of a service (the placement's HOST_<NAME>)
  local var="HOST_${1^^}"
  var=${var//-/_}
  echo "${!var}"
}
gpus_of() {  # gpus_of NAME: its CUDA_VISIBLE_DEVICES, empty without GPU placement
  local var="GPUS_${1^^}"
  var=${var//-/_}
  echo "${!var}"
}

# -- check: what the run needs (async-vapo check), before a run directory is claimed or anything started ---------
if [ "$CHECK" = 1 ] && [ "$DRY_RUN" = 0 ]; then
  check_args=(--for cluster --local-name "$(hostname)" ${HOSTFILE:+--hostfile "$HOSTFILE"} ${RUN_DIR_ARG:+--run-dir "$RUN_DIR_ARG"})
  "$PY" -m async_vapo.cli check "${CONFIGS[@]}" "${check_args[@]}" "${OVERRIDES[@]}" >&2 \
    || { echo "start_cluster: async-vapo check stopped the start (above; --no-check skips it); nothing was started" >&2
         exit 2; }
fi

# -- plan: resolved config -> run dir, counts, health URLs; writes RUN_DIR/prometheus/* -----------------------
[ "$NEW_RUN" = 1 ] && [ -n "$RESUME" ] && { echo "start_cluster: --new-run and --resume exclude each other" >&2; exit 2; }
plan_args=(--gpus-per-host "$GPUS_PER_HOST" --local-name "$(hostname)" --local-addr "${LOCAL_ADDR:-127.0.0.1}")
for h in "$(hostname -f 2>/dev/null)" "$(hostname -s 2>/dev/null)"; do [ -n "$h" ] && plan_args+=(--local-name "$h"); done
[ -n "$HOSTFILE" ] && plan_args+=(--hostfile "$HOSTFILE")
[ "$DRY_RUN" = 1 ] && plan_args+=(--dry-run)
[ "$NEW_RUN" = 1 ] && plan_args+=(--new-run)
PLAN=$("$PY" -m async_vapo.deploy.launch plan "${CONFIGS[@]}" ${RUN_DIR_ARG:+--run-dir "$RUN_DIR_ARG"} \
       ${RESUME:+--resume "$RESUME"} --scrape-interval "$INTERVAL" "${plan_args[@]}" -- "${OVERRIDES[@]}") \
  || { echo "start_cluster: no plan (above: why)" >&2; exit 2; }
eval "$PLAN"
if [ "$EVALUATOR" = after ] && [ "$WAIT" = 0 ] && [ "$DRY_RUN" = 0 ]; then
  echo "start_cluster: cluster.evaluator.mode = after evaluates once the run is done, so it needs --wait (or set" \
       "cluster.evaluator.mode = watch, or run async-vapo eval $RUN_DIR after the run); nothing was started" >&2
  exit 2
fi
[ -n "$ROLLOUT_HOSTS_OVERRIDE" ] && OVERRIDES+=("$ROLLOUT_HOSTS_OVERRIDE")
read -ra LEARNERS <<< "$LEARNER_AGENTS"  # the learner's torchrun agents by node rank: learner, learner-1, ...

# -- CPU placement (GPUs: the plan's GPUS_<NAME>) -----------------------------------------------------------------------------------------------------
ROLLOUT_CPUS=() LEARNER_CPUS="" LEARNER_OVERRIDES=() ROLLOUT_OVERRIDES=()
ncpu=$(nproc)
if [ "$PIN" = 1 ] && [ -z "$HOSTFILE" ] && [ "$GPUS_PER_HOST" = 0 ] && command -v taskset >/dev/null \
   && ! command -v nvidia-smi >/dev/null && [ "$ncpu" -ge 2 ]; then
  r=$(( ncpu * N_ROLLOUT / (N_ROLLOUT + N_LEARNER) ))
  [ "$r" -lt 1 ] && r=1
  [ "$r" -ge "$ncpu" ] && r=$(( ncpu - 1 ))
  LEARNER_CPUS="$r-$(( ncpu - 1 ))"
  if [ "$LEND_CPUS" = 1 ] && [ "$N_LEARNER" = 1 ]; then
    # cores follow the work (cluster.deploy.lend_cpus): the learner may run on every core; its own share is its torch
    # threads while an engine generates, and it takes every core while all engines wait for a version
    LEARNER_CPUS="0-$(( ncpu - 1 ))" LEARNER_OVERRIDES=("train.threads=$(( ncpu - r ))")
  fi
  for ((i = 0; i < N_ROLLOUT; i++)); do
    if [ "$LEND_CPUS" = 1 ] && [ "$N_LEARNER" = 1 ] && [ "$N_ROLLOUT" = 1 ] && [ "$CONTINUOUS" = 1 ]; then
      # and back: one continuous engine runs on every core, its own share as its threads while the learner works,
      # every core while the learner waits for a batch (cluster.rollout.engine_threads)
      ROLLOUT_CPUS+=("0-$(( ncpu - 1 ))") ROLLOUT_OVERRIDES=("cluster.rollout.engine_threads=$r")
    elif [ "$r" -ge "$N_ROLLOUT" ]; then
      lo=$(( i * r / N_ROLLOUT )); hi=$(( (i + 1) * r / N_ROLLOUT - 1 ))
      ROLLOUT_CPUS+=("$lo-$hi")
    else
      ROLLOUT_CPUS+=("0-$(( r - 1 ))")
    fi
  done
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "# deploy/start_cluster.sh --dry-run, nothing started: it would start $N_ROLLOUT engine(s), $N_LEARNER learner rank(s), $GPUS_PER_HOST GPU(s) per host"
  echo "$PLACEMENT_TABLE"
  if [ "$GPUS_PER_HOST" != 0 ]; then  # async-vapo plan's memory check of this placement (exit 1: does not fit)
    mem_args=(--gpus-per-host "$GPUS_PER_HOST")
    [ -n "$HOSTFILE" ] && mem_args+=(--hostfile "$HOSTFILE")
    [ -n "${ASYNC_VAPO_GPU_MEMORY_GIB:-}" ] && mem_args+=(--gpu-memory-gib "$ASYNC_VAPO_GPU_MEMORY_GIB")
    "$PY" -m async_vapo.deploy.launch memory-check "${CONFIGS[@]}" "${mem_args[@]}" -- "${OVERRIDES[@]}" \
      || { echo "start_cluster: the plan does not fit its GPUs (above)" >&2; exit 1; }
  fi
  echo "# commands (RUN_DIR $RUN_DIR) it would run:"
fi
if [ "$DRY_RUN" = 0 ]; then
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/pids"
# A cluster still running in RUN_DIR (remote groups checked over ssh, with the command the old run recorded
# unless ASYNC_VAPO_SSH is set: as deploy/stop_cluster.sh does)
OLD_SSH=("${SSH[@]}")
if [ -z "${ASYNC_VAPO_SSH:-}" ] && [ -f "$RUN_DIR/pids/cluster.env" ]; then
  old=$(sed -n 's/^ASYNC_VAPO_SSH=//p' "$RUN_DIR/pids/cluster.env")
  [ -n "$old" ] && read -ra OLD_SSH <<< "$old"
fi
for f in "$RUN_DIR"/pids/*.pid; do
  [ -e "$f" ] || continue
  name=$(basename "$f" .pid) running=0
  if [ -e "$RUN_DIR/pids/$name.host" ]; then
    host=$(cat "$RUN_DIR/pids/$name.host") rc=0
    "${OLD_SSH[@]}" "$host" "bash -c $(q "kill -0 -- -$(cat "$f")")" < /dev/null 2>/dev/null || rc=$?
    [ "$rc" = 0 ] && running=1
    if [ "$rc" = 255 ]; then
      echo "start_cluster: cannot check $name on $host over ssh (${OLD_SSH[*]}); stop it first or remove $RUN_DIR/pids:" >&2
      echo "  deploy/stop_cluster.sh $RUN_DIR" >&2
      exit 1
    fi
  elif kill -0 -- "-$(cat "$f")" 2>/dev/null; then
    running=1
  fi
  if [ "$running" = 1 ]; then
    echo "start_cluster: $RUN_DIR already has a running cluster ($name); stop it first:" >&2
    echo "  deploy/stop_cluster.sh $RUN_DIR" >&2
    exit 1
  fi
done
# ... and a supervisord of an earlier start still running there (it would restart what it supervises)
if [ -f "$RUN_DIR/supervisor/hosts" ]; then
  while read -r tag host; do
    chk="p=\$(cat $(q "$RUN_DIR/supervisor/$tag.pid") 2>/dev/null) && tr '\\0' ' ' < /proc/\$p/cmdline 2>/dev/null \
| grep -qF $(q "$RUN_DIR/supervisor/$tag.conf")"
    if [ "$host" = - ]; then rc=0; bash -c "$chk" || rc=$?
    else rc=0; "${OLD_SSH[@]}" "$host" "bash -c $(q "$chk")" < /dev/null 2>/dev/null || rc=$?; fi
    if [ "$rc" != 1 ]; then
      echo "start_cluster: $RUN_DIR has a supervisord still running ($tag) or unchecked; stop it first:" >&2
      echo "  deploy/stop_cluster.sh $RUN_DIR" >&2
      exit 1
    fi
  done < "$RUN_DIR/supervisor/hosts"
fi
rm -f "$RUN_DIR"/pids/* "$RUN_DIR/DONE" "$RUN_DIR/eval/DONE"
ASYNC_VAPO_T0=$(date +%s.%N)
export ASYNC_VAPO_T0
# ASYNC_VAPO_T0, recorded: the origin of every service's clock (wall_s in metrics.jsonl and the busy logs), epoch seconds
printf 'STOP_GRACE=%s\nASYNC_VAPO_SSH=%s\nASYNC_VAPO_T0=%s\n' "$STOP_GRACE" "$SSH_CMD" "$ASYNC_VAPO_T0" \
  > "$RUN_DIR/pids/cluster.env"
echo "[start_cluster] run dir $RUN_DIR: $N_ROLLOUT rollout engine(s), $N_LEARNER learner rank(s)" >&2

# -- the base model is built once here, not by four services at the same time (its progress on the terminal) ------
if [ -z "$POLICY_PATH" ]; then
  "$PY" -m async_vapo.cli make-base "${CONFIGS[@]}" "${OVERRIDES[@]}" 2>&1 >> "$RUN_DIR/logs/make-base.log" \
    | tee -a "$RUN_DIR/logs/make-base.log" >&2 \
    || { echo "start_cluster: building the base model failed (above; $RUN_DIR/logs/make-base.log)" >&2; exit 1; }
fi

# -- keys: one CURVE key pair per role (cluster.security), made here; remote hosts get theirs when started --------
if [ "$CURVE" = 1 ]; then
  "$PY" -m async_vapo.transport.security create "$KEYS_DIR" > /dev/null \
    || { echo "start_cluster: creating the cluster's keys in $KEYS_DIR failed" >&2; exit 1; }
fi
hand_keys() {  # hand_keys HOST ROLE: the role's secret key and every public key, over the same ssh (0700 / 0600)
  [ "$CURVE" = 1 ] || return 0
  local files=("$2.key_secret") r
  for r in replay verifier rollout learner; do files+=("$r.key" "public/$r/$r.key"); done
  tar -C "$KEYS_DIR" -cf - "${files[@]}" | "${SSH[@]}" "$1" "bash -c $(q "umask 077; mkdir -p $(q "$KEYS_DIR") \
&& chmod 700 $(q "$KEYS_DIR") && tar -C $(q "$KEYS_DIR") -xf - && chmod 600 $(q "$KEYS_DIR/$2.key_secret")")" \
    || fail_start "handing the keys of $2 to $1 over ssh failed (ASYNC_VAPO_SSH='$SSH_CMD')"
}
fi  # DRY_RUN = 0

# -- start ---------------------------------------------------------------------------------------------------------
STARTED=()
FORWARD_ENV='^(ASYNC_VAPO_[A-Z0-9_]+|VLLM_[A-Z0-9_]+|HF_[A-Z0-9_]+|TRANSFORMERS_[A-Z0-9_]+|TORCH_[A-Z0-9_]+|NCCL_[A-Z0-9_]+'
FORWARD_ENV+='|GLOO_[A-Z0-9_]+|OMP_NUM_THREADS|MKL_NUM_THREADS|CUDA_VISIBLE_DEVICES|TOKENIZERS_PARALLELISM)$'
remote_env() {  # the environment a remote service gets, as quoted words for env(1)
  local v out
  out="$(q "PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}")"
  for v in $(compgen -e); do
    [[ $v =~ $FORWARD_ENV ]] && [ "$v" != ASYNC_VAPO_SSH ] && out+=" $(q "$v=${!v}")"
  done
  echo "$out"
}
fail_start() {  # fail_start MESSAGE: stop what was started, exit 1
  echo "start_cluster: $1" >&2
  "$REPO/deploy/stop_cluster.sh" "$RUN_DIR" >&2 || true
  exit 1
}
# One supervisord per host runs that host's services (async_vapo.deploy.supervise). `start` writes a service's
# launcher, RUN_DIR/supervisor/NAME.sh, which supervisord runs at every (re)start: it records the PID (= the
# service's process-group id: supervisord gives each program a group of its own, and the launcher ends in exec) in
# RUN_DIR/pids/NAME.pid and one line per start in RUN_DIR/supervisor/NAME.starts, and appends to RUN_DIR/logs/NAME.log.
SUP="$RUN_DIR/supervisor"
SUP_TAGS=()
declare -A SUP_PROGS=() SUP_HOST=() SUP_TAG=()  # tag -> names, tag -> host, name -> tag
sup_tag() { if is_local "$1"; then echo local; else printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' _; fi; }
[ "$DRY_RUN" = 1 ] || { rm -rf "$SUP"; mkdir -p "$SUP"; }
launcher() {  # launcher NAME TAG CPUS CMD...: writes RUN_DIR/supervisor/NAME.sh
  local name=$1 tag=$2 cpus=$3 gpus; shift 3
  gpus=$(gpus_of "$name")
  local words="" a
  for a in "$@"; do
    # a restarted learner resumes from the newest checkpoint of this run (argparse: the last --resume wins)
    [ "$name" = learner ] && [ "$a" = -- ] && words+=' "${resume[@]}"'
    words+=" $(q "$a")"
  done
  {
    echo "# $name: what supervisord ($SUP/$tag.conf) runs at every start; written by deploy/start_cluster.sh"
    echo "echo \$\$ > $(q "$RUN_DIR/pids/$name.pid")"
    echo "exec >> $(q "$RUN_DIR/logs/$name.log") 2>&1 < /dev/null"
    echo "echo \$\$ >> $(q "$SUP/$name.starts")"
    echo "n=\$(wc -l < $(q "$SUP/$name.starts"))"
    if [ "$name" = learner ]; then
      echo "resume=()"
      echo "if [ \"\$n\" -gt 1 ]; then"
      echo "  step=\$(find $(q "$RUN_DIR/checkpoints") -mindepth 2 -maxdepth 2 -name learner_state.pt \\"
      echo "         -newer $(q "$SUP/$tag.conf") 2>/dev/null \\"
      echo "         | sed -n 's|.*/step_\\([0-9]*\\)/learner_state.pt\$|\\1|p' | sort -n | tail -n 1)"
      echo "  [ -n \"\$step\" ] && resume=(--resume $(q "$RUN_DIR/checkpoints")/step_\$step)"
      echo "fi"
    fi
    echo "echo \"[supervise] $name: start \$n, pid \$\$, \$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)\""
    [ -n "$gpus" ] && echo "export CUDA_VISIBLE_DEVICES=$(q "$gpus")"
    if [ -n "$cpus" ]; then
      echo "VLLM_CPU_OMP_THREADS_BIND=$(q "$cpus") exec taskset -c $(q "$cpus")$words"
    else
      echo "exec$words"
    fi
  } > "$SUP/$name.sh"
}
sup_add() {  # sup_add NAME HOST: NAME runs under the supervisord of HOST's tag
  local tag
  tag=$(sup_tag "$2")
  [ -n "${SUP_HOST[$tag]+x}" ] || { SUP_TAGS+=("$tag"); SUP_HOST[$tag]=$2; SUP_PROGS[$tag]=""; }
  SUP_TAG[$1]=$tag
}
start() {  # start NAME HOST CPUS CMD...: NAME will run under HOST's supervisord (launch_supervisors)
  local name=$1 host=$2 cpus=$3; shift 3
  if [ "$DRY_RUN" = 1 ]; then
    local env="" a
    [ -n "$(gpus_of "$name")" ] && env="CUDA_VISIBLE_DEVICES=$(gpus_of "$name") "
    [ -n "$cpus" ] && env="taskset -c $cpus "
    printf '%s\t%s\t%s' "$name" "$host" "$env"
    for a in "$@"; do printf ' %s' "$(q "$a")"; done
    echo
    return
  fi
  sup_add "$name" "$host"
  SUP_PROGS[${SUP_TAG[$name]}]+=" $name"
  launcher "$name" "${SUP_TAG[$name]}" "$cpus" "$@"
  STARTED+=("$name")
}
launch_supervisors() {  # writes each host's RUN_DIR/supervisor/TAG.conf and starts its supervisord (over ssh)
  local tag host conf f script out rc name extra
  for tag in "${SUP_TAGS[@]}"; do
    host=${SUP_HOST[$tag]} conf="$SUP/$tag.conf" extra=()
    [ "$tag" = local ] && [ -n "$PROM_LAUNCHED" ] && extra=(--extra prometheus)
    # shellcheck disable=SC2086  # the names are words
    "$PY" -m async_vapo.deploy.supervise conf "${CONFIGS[@]}" --run-dir "$RUN_DIR" --tag "$tag" --python "$PY" \
      --programs ${SUP_PROGS[$tag]} "${extra[@]}" -- "${OVERRIDES[@]}" > /dev/null \
      || fail_start "writing the supervisor config of $host failed"
    if [ "$tag" = local ]; then
      echo "$tag -" >> "$SUP/hosts"
      "$PY" -m supervisor.supervisord -c "$conf" \
        || fail_start "supervisord did not start: $(tail -n 20 "$RUN_DIR/logs/supervisord-$tag.log" 2>/dev/null)"
    else
      echo "$tag $host" >> "$SUP/hosts"
      for name in ${SUP_PROGS[$tag]}; do  # its roles' CURVE keys (the evaluator opens no socket)
        [ "$name" = evaluator ] || hand_keys "$host" "${name%%-*}"
      done
      script="cd $(q "$REPO") || exit 1; mkdir -p $(q "$RUN_DIR/logs") $(q "$RUN_DIR/pids") $(q "$SUP") || exit 1"
      for f in "$conf" $(for name in ${SUP_PROGS[$tag]}; do echo "$SUP/$name.sh"; done); do
        script+="; printf '%s\n' $(q "$(cat "$f")") > $(q "$f") || exit 1"
      done
      for name in ${SUP_PROGS[$tag]}; do
        script+="; rm -f $(q "$SUP/$name.starts") $(q "$SUP/$name.gave_up") $(q "$RUN_DIR/pids/$name.pid")"
      done
      script+="; rm -f $(q "$SUP/events-$tag.jsonl")"
      script+="; env $(remote_env) $(q "$PY") -m supervisor.supervisord -c $(q "$conf")"
      rc=0
      out=$(remote "$host" "$script" 2>&1) || rc=$?
      [ "$rc" = 0 ] \
        || fail_start "starting supervisord on $host over ssh failed (exit $rc, output '$out'; ASYNC_VAPO_SSH='$SSH_CMD')"
    fi
  done
  # supervisord starts every program right after it daemonized; each launcher writes its PID first thing
  for name in "${STARTED[@]}" ${PROM_LAUNCHED:+prometheus}; do
    tag=${SUP_TAG[$name]} f="$RUN_DIR/pids/$name.pid"
    if [ "$tag" = local ]; then
      for _ in $(seq 300); do [ -s "$f" ] && break; sleep 0.1; done
      [ -s "$f" ] || fail_start "supervisord did not start $name ($RUN_DIR/logs/supervisord-local.log)"
    else
      rc=0
      out=$(remote "${SUP_HOST[$tag]}" \
            "for i in \$(seq 300); do [ -s $(q "$f") ] && exec cat $(q "$f"); sleep 0.1; done; exit 1") || rc=$?
      [[ $rc = 0 && $out =~ ^[0-9]+$ ]] || fail_start "supervisord did not start $name on ${SUP_HOST[$tag]} (exit $rc)"
      echo "$out" > "$f"
      echo "${SUP_HOST[$tag]}" > "$RUN_DIR/pids/$name.host"
    fi
  done
}
svc_args=("${CONFIGS[@]}" --run-dir "$RUN_DIR")
start replay "$(host_of replay)" "" "$PY" -m async_vapo.services.replay "${svc_args[@]}" -- "${OVERRIDES[@]}"
start verifier "$(host_of verifier)" "" "$PY" -m async_vapo.services.verifier "${svc_args[@]}" -- "${OVERRIDES[@]}"
for ((i = 0; i < N_ROLLOUT; i++)); do
  start "rollout-$i" "$(host_of "rollout-$i")" "${ROLLOUT_CPUS[$i]:-}" "$PY" -m async_vapo.services.rollout \
    "${svc_args[@]}" --instance "$i" -- "${OVERRIDES[@]}" "${ROLLOUT_OVERRIDES[@]}"
done
learn_extra=()
[ -n "$RESUME" ] && learn_extra=(--resume "$RESUME")
if [ ${#LEARNERS[@]} -gt 1 ]; then  # one torchrun agent per learner host (header: "Learner on several hosts")
  T0=${ASYNC_VAPO_T0:-$(date +%s)}
  rdzv=(--nnodes ${#LEARNERS[@]} --nproc-per-node "$LEARNER_RANKS_PER_HOST" --rdzv-backend c10d
        --rdzv-endpoint "$ADDR_LEARNER:$LEARNER_RDZV_PORT" --rdzv-id "async-vapo-$(basename "$RUN_DIR")-${T0%%.*}"
        --max-restarts 0)
  for i in "${!LEARNERS[@]}"; do
    name=${LEARNERS[$i]} addr_var="ADDR_${LEARNERS[$i]^^}"
    addr_var=${addr_var//-/_}
    start "$name" "$(host_of "$name")" "" "$PY" -m torch.distributed.run "${rdzv[@]}" --node-rank "$i" \
      --local-addr "${!addr_var}" --rdzv-conf "is_host=$([ "$i" = 0 ] && echo 1 || echo 0)" \
      -m async_vapo.services.learner "${svc_args[@]}" "${learn_extra[@]}" --node-rank "$i" --host-addr "${!addr_var}" \
      --resume-since "$SUP/$(sup_tag "$(host_of "$name")").conf" -- "${OVERRIDES[@]}"
  done
elif [ "$N_LEARNER" -gt 1 ]; then
  start learner "$(host_of learner)" "$LEARNER_CPUS" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$N_LEARNER" -m async_vapo.services.learner "${svc_args[@]}" "${learn_extra[@]}" -- "${OVERRIDES[@]}"
else
  start learner "$(host_of learner)" "$LEARNER_CPUS" "$PY" -m async_vapo.services.learner "${svc_args[@]}" \
    "${learn_extra[@]}" -- "${OVERRIDES[@]}" "${LEARNER_OVERRIDES[@]}"
fi
if [ "$EVALUATOR" = watch ]; then  # held-out evaluation of each checkpoint with an engine of its own
  start evaluator "$(host_of evaluator)" "" "$PY" -m async_vapo.cli eval "$RUN_DIR" --watch
fi
[ "$DRY_RUN" = 1 ] && exit 0
PROM_LAUNCHED=""
if [ "$PROM" = 1 ]; then
  if command -v prometheus >/dev/null; then
    sup_add prometheus localhost  # outside the services group: supervisord restarts it itself
    launcher prometheus local "" prometheus --config.file="$RUN_DIR/prometheus/prometheus.yml" \
      --storage.tsdb.path="$RUN_DIR/prometheus/data" --web.listen-address="127.0.0.1:$PROM_PORT"
    PROM_LAUNCHED=1
    echo "[start_cluster] prometheus on http://127.0.0.1:$PROM_PORT" >&2
  else
    echo "[start_cluster] --prometheus: no prometheus binary on PATH (.ci/install_prometheus.sh); skipped" >&2
  fi
fi
launch_supervisors

# -- health --------------------------------------------------------------------------------------------------------
health_url() {  # health_url NAME -> the plan's URL (on the role's host)
  local name=$1 role=${1%%-*} idx=0 var
  [ "$name" != "$role" ] && idx=${name##*-}
  var="HEALTH_${role^^}_${idx}"
  echo "${!var}"
}
alive() {  # alive NAME: its process still runs (a remote one checked over ssh; ssh failing counts as alive)
  local pid rc=0
  pid=$(cat "$RUN_DIR/pids/$1.pid")
  [ -e "$RUN_DIR/pids/$1.host" ] || { kill -0 "$pid" 2>/dev/null; return; }
  remote "$(cat "$RUN_DIR/pids/$1.host")" "kill -0 $pid" 2>/dev/null || rc=$?
  [ "$rc" != 1 ]
}
supervised() {  # supervised NAME: runs, or will be restarted (not given up); over ssh, ssh failing counts as yes
  local tag=${SUP_TAG[$1]} rc=0 chk
  chk="test ! -e $(q "$SUP/$1.gave_up") && { kill -0 -- -\$(cat $(q "$RUN_DIR/pids/$1.pid")) \
|| kill -0 \$(cat $(q "$SUP/$tag.pid")); } 2>/dev/null"
  [ "$tag" = local ] && { bash -c "$chk"; return; }
  remote "${SUP_HOST[$tag]}" "$chk" 2>/dev/null || rc=$?
  [ "$rc" != 1 ]
}
wait_health_remote() {  # wait_health_remote NAME URL TIMEOUT_S: wait-health in short rounds, checking the process
  local deadline=$(( SECONDS + $3 ))
  while :; do
    "$PY" -m async_vapo.deploy.launch wait-health "${HEALTH_OPTS[@]}" "$2" 5 2>/dev/null && return 0
    alive "$1" || { echo "$1 ($(cat "$RUN_DIR/pids/$1.host")) exited before $2 became healthy" >&2; return 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "$2 not healthy after $3 s" >&2; return 1; }
  done
}
wait_health_learners() {  # wait_health_learners URL TIMEOUT_S: rank 0's health in short rounds, while every agent runs
  local deadline=$(( SECONDS + $2 )) a
  while :; do
    "$PY" -m async_vapo.deploy.launch wait-health "${HEALTH_OPTS[@]}" "$1" 5 2>/dev/null && return 0
    for a in "${LEARNERS[@]}"; do
      alive "$a" || { echo "$a ($(host_of "$a")) exited before $1 became healthy" >&2; name=$a; return 1; }
    done
    [ "$SECONDS" -lt "$deadline" ] || { echo "$1 not healthy after $2 s" >&2; return 1; }
  done
}
for name in "${STARTED[@]}"; do
  if [ "$name" = evaluator ]; then  # no socket, no health: it runs, or it says why in its log
    alive evaluator || { echo "[start_cluster] the evaluator exited at once; last lines of" \
                              "$RUN_DIR/logs/evaluator.log:" >&2; tail -n 40 "$RUN_DIR/logs/evaluator.log" >&2 || true
                         "$REPO/deploy/stop_cluster.sh" "$RUN_DIR" >&2 || true; exit 1; }
    echo "[start_cluster] evaluator runs ($(host_of evaluator)${GPUS_EVALUATOR:+, GPUs $GPUS_EVALUATOR})" >&2
    continue
  fi
  if [ ${#LEARNERS[@]} -gt 1 ] && [[ $name = learner* ]]; then
    # rank 0 answers /health once every agent joined its group; the other agents serve no health of their own
    if [ "$name" = learner ]; then
      wait_health_learners "$(health_url learner)" "$HEALTH_TIMEOUT" && ok=1 || ok=0
    else
      alive "$name" && ok=1 || ok=0
      [ "$ok" = 1 ] && { echo "[start_cluster] $name runs in the learner's group ($(host_of "$name"))" >&2; continue; }
    fi
  elif [ -e "$RUN_DIR/pids/$name.host" ]; then
    wait_health_remote "$name" "$(health_url "$name")" "$HEALTH_TIMEOUT" && ok=1 || ok=0
  else
    "$PY" -m async_vapo.deploy.launch wait-health "${HEALTH_OPTS[@]}" "$(health_url "$name")" "$HEALTH_TIMEOUT" \
      "$(cat "$RUN_DIR/pids/$name.pid")" && ok=1 || ok=0
  fi
  if [ "$ok" = 0 ]; then
    if [ -e "$RUN_DIR/pids/$name.host" ]; then
      host=$(cat "$RUN_DIR/pids/$name.host")
      echo "[start_cluster] $name did not become healthy; last lines of $RUN_DIR/logs/$name.log on $host:" >&2
      remote "$host" "tail -n 40 $(q "$RUN_DIR/logs/$name.log")" >&2 || true
    else
      echo "[start_cluster] $name did not become healthy; last lines of $RUN_DIR/logs/$name.log:" >&2
      tail -n 40 "$RUN_DIR/logs/$name.log" >&2 || true
    fi
    "$REPO/deploy/stop_cluster.sh" "$RUN_DIR" >&2 || true
    exit 1
  fi
  echo "[start_cluster] $name healthy ($(health_url "$name"))" >&2
done
echo "[start_cluster] all services up; logs in $RUN_DIR/logs; stop with: deploy/stop_cluster.sh $RUN_DIR" >&2

on_host_of() {  # on_host_of NAME SCRIPT: run SCRIPT where NAME runs (its RUN_DIR is there)
  if [ -e "$RUN_DIR/pids/$1.host" ]; then remote "$(cat "$RUN_DIR/pids/$1.host")" "$2"; else bash -c "$2"; fi
}
PROGRESS_PY='import json, sys
rows = [json.loads(x) for x in sys.stdin.read().strip().splitlines()[-3:]]
r, critic = rows[-1], ""
if r["kind"] == "critic_eval":  # the learner scored its critic on an evaluation: show that evaluation with it
    critic = ", the critic'"'"'s held-out explained variance %.3f" % (r.get("critic/heldout_ev") or 0)
    r = next((x for x in rows if x["kind"] == "eval" and x["step"] == r["step"]), r)
t = " (%.0f s since start)" % r["wall_s"] if r.get("wall_s") is not None else ""
if r["kind"] == "train":
    print("update %d of %s: training accuracy %.3f, %.1f s/update%s" % (r["step"], sys.argv[1],
          r.get("rollout/accuracy") or 0, r.get("time/step_s") or 0, t))
elif r["kind"] == "pretrain":
    print("value pretraining step %d: value loss %.3f%s" % (r["step"] + 1, r.get("critic/value_loss") or 0, t))
elif r["kind"] == "eval":
    print("held-out accuracy %.3f at update %d%s%s" % (r.get("eval/accuracy") or 0, r["step"], critic, t))'
if [ "$WAIT" = 1 ]; then
  done_file=$(q "$RUN_DIR/DONE") metrics=$(q "$RUN_DIR/metrics.jsonl")
  # the training's progress on the terminal: the newest row of metrics.jsonl, looked at every 10 s
  shown=""
  show_progress() {
    local line
    line=$(on_host_of learner "tail -n 3 $metrics" 2>/dev/null | "$PY" -S -c "$PROGRESS_PY" "$TOTAL_STEPS" \
           2>/dev/null) || line=""
    [ -n "$line" ] && [ "$line" != "$shown" ] && { echo "[start_cluster] $line" >&2; shown=$line; }
    return 0
  }
  learners_supervised() {  # every learner agent runs or will be restarted
    local a
    for a in "${LEARNERS[@]}"; do supervised "$a" || return 1; done
  }
  i=0
  while ! on_host_of learner "test -e $done_file" && learners_supervised; do
    [ $(( i++ % 5 )) = 0 ] && show_progress
    sleep 2
  done
  # rollout 0 evaluates the last version once it has loaded it: give it up to 2 minutes (when it evaluates at all)
  if last=$(on_host_of learner "cat $done_file" 2>/dev/null) \
     && on_host_of rollout-0 "grep -q '\"kind\": \"eval\"' $metrics" 2>/dev/null; then
    for _ in $(seq 60); do
      on_host_of rollout-0 "grep -q '\"kind\": \"eval\", \"step\": $last,' $metrics" && break
      sleep 2
    done
  fi
  # and the learner scores its critic on that evaluation's responses (a run with a critic): up to 20 s more
  if [ -n "${last:-}" ] && on_host_of learner "grep -q '\"kind\": \"critic_eval\"' $metrics" 2>/dev/null; then
    for _ in $(seq 10); do
      on_host_of learner "grep -q '\"kind\": \"critic_eval\", \"step\": $last,' $metrics" && break
      sleep 2
    done
  fi
  # the evaluator (cluster.evaluator.mode = watch) evaluates the checkpoints it has not yet, then writes eval/DONE
  if [ "$EVALUATOR" = watch ] && on_host_of learner "test -e $done_file"; then
    echo "[start_cluster] the learner is done; the evaluator evaluates the checkpoints it has not yet" >&2
    while ! on_host_of evaluator "test -e $(q "$RUN_DIR/eval/DONE")" \
          && ! on_host_of evaluator "test -e $(q "$SUP/evaluator.gave_up")"; do
      [ $(( i++ % 5 )) = 0 ] && show_progress
      sleep 2
    done
  fi
  show_progress
  "$REPO/deploy/stop_cluster.sh" "$RUN_DIR"
  if [ "$EVALUATOR" = after ] && on_host_of learner "test -e $done_file"; then
    echo "[start_cluster] evaluating the run's checkpoints (cluster.evaluator.mode = after; RUN_DIR/logs/evaluator.log)" >&2
    ev=(-m async_vapo.cli eval "$RUN_DIR")
    if [ -e "$RUN_DIR/pids/learner.host" ]; then
      cmd="cd $(q "$REPO") && env $(remote_env) $(q "$PY")"
      for a in "${ev[@]}"; do cmd+=" $(q "$a")"; done
      remote "$(cat "$RUN_DIR/pids/learner.host")" "$cmd >> $(q "$RUN_DIR/logs/evaluator.log") 2>&1" \
        || { echo "[start_cluster] the evaluation failed (exit $?; $RUN_DIR/logs/evaluator.log there)" >&2; exit 1; }
    else
      rc=0
      "$PY" "${ev[@]}" 2>&1 | tee -a "$RUN_DIR/logs/evaluator.log" >&2 || rc=$?
      [ "$rc" = 0 ] || { echo "[start_cluster] the evaluation failed (exit $rc; $RUN_DIR/logs/evaluator.log)" >&2; exit 1; }
    fi
  fi
  if ! on_host_of learner "test -e $done_file"; then
    why=""
    for a in "${LEARNERS[@]}"; do
      w=$(on_host_of "$a" "cat $(q "$SUP/$a.gave_up")" 2>/dev/null) || continue
      [ ${#LEARNERS[@]} -gt 1 ] && w="$a: $w"
      why+="${why:+; }$w"
    done
    echo "[start_cluster] the learner exited before finishing${why:+ (not restarted: $why)}" >&2
    exit 1
  fi
fi
