#!/usr/bin/env bash
# start_cluster.sh's remote call as a Slurm job step instead of ssh: deploy/slurm/async_vapo.sbatch sets
# ASYNC_VAPO_SSH to this file, so every call `ASYNC_VAPO_SSH HOST "bash -c '...'"` (start, liveness checks, log tails,
# key hand-over, stop) runs as `srun --overlap --nodes=1 --ntasks=1 --nodelist=HOST` inside the job: no ssh between
# nodes, and every process is in the job (Slurm ends them with it).
#
#   deploy/slurm/srun_remote.sh HOST COMMAND
#
# A command that leaves processes running (supervisord daemonizes, and so do the services under it) would lose them
# when its step ends: Slurm kills what is left of a step. So the step stays while any process other than its own
# shell and that shell's children is in it (`scontrol listpids JOB.STEP` on that node, every 10 s), and this call
# returns as soon as the command itself is done, with its exit status and output; the step then holds in the
# background until its processes are gone (stop_cluster.sh) or the job ends. Standard input is passed to the step
# (the key hand-over pipes a tar archive). The step asks for no GRES, so it gets the job's GPUs on that node (Slurm's
# default for a step within a job of whole nodes); placement's CUDA_VISIBLE_DEVICES numbers them 0..N-1. Untested on a
# real slurmctld: tests/unit/test_slurm.py runs it against an srun that runs the step here.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: srun_remote.sh HOST COMMAND" >&2; exit 2; }
host=$1; shift
[ -n "${SLURM_JOB_ID:-}" ] || { echo "srun_remote.sh: not inside a Slurm job (no SLURM_JOB_ID)" >&2; exit 2; }
# shellcheck disable=SC2016  # expanded in the step
hold='me=$$; while :; do left=0
  for p in $(scontrol listpids "$SLURM_JOB_ID.$SLURM_STEP_ID" 2>/dev/null | awk "NR > 1 {print \$1}"); do
    [ "$p" = "$me" ] && continue
    pp=$(ps -o ppid= -p "$p" 2>/dev/null | tr -d " ") || continue
    [ -n "$pp" ] && [ "$pp" != "$me" ] && { left=1; break; }
  done
  [ "$left" = 0 ] && exit 0; sleep 10; done'
out=$(mktemp "${TMPDIR:-/tmp}/srun-remote.XXXXXX") err=$(mktemp "${TMPDIR:-/tmp}/srun-remote.XXXXXX")
trap 'rm -f "$out" "$err"' EXIT
exec 3<&0  # a background job's stdin would be /dev/null
# the command's exit status follows its output on stdout as one marker line; then the step holds
srun --jobid="$SLURM_JOB_ID" --overlap --nodes=1 --ntasks=1 --nodelist="$host" --job-name="async-vapo@$host" \
  --quiet bash -c "$*"'
rc=$?; printf "\n__ASYNC_VAPO_RC=%s\n" "$rc"; exec >/dev/null 2>&1 </dev/null
'"$hold" <&3 > "$out" 2> "$err" &
step=$!
rc=""
while [ -z "$rc" ]; do
  rc=$(sed -n 's/^__ASYNC_VAPO_RC=\([0-9]*\)$/\1/p' "$out")
  if [ -z "$rc" ] && ! kill -0 "$step" 2>/dev/null; then  # the step ended without a status: srun's own failure
    wait "$step"
    rc=$(sed -n 's/^__ASYNC_VAPO_RC=\([0-9]*\)$/\1/p' "$out")
    [ -n "$rc" ] || { cat "$out"; cat "$err" >&2; echo "srun_remote.sh: srun on $host failed" >&2; exit 255; }
  fi
  [ -n "$rc" ] || sleep 0.2
done
# the output less the marker and the newline before it
sed -e '/^__ASYNC_VAPO_RC=[0-9]*$/d' "$out" | sed -e '$ { /^$/d }'
cat "$err" >&2
exit "$rc"
