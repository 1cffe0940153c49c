#!/bin/bash
# Stop what launchers/slurm_local/start.sh started, by PID file, in reverse order. Cancels running jobs first
# so that no job step survives its slurmd. Usage: launchers/slurm_local/stop.sh [--wipe]
#   --wipe  also delete spool, database and logs (job ids restart at 1; keeps configs and the munge key)
set -uo pipefail
S=${SCALEOUT_SLURM_STATE:-/tmp/scaleout-slurm}
[ -d "$S" ] || { echo "stop.sh: nothing at $S"; exit 0; }
exec 9>"$S/.lock"
flock -w 120 9 || { echo "stop.sh: another start/stop holds $S/.lock" >&2; exit 4; }
export SLURM_CONF=$S/etc/slurm.conf
if [ -f "$S/run/slurmctld.pid" ] && kill -0 "$(cat "$S/run/slurmctld.pid")" 2>/dev/null; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
for f in "$S"/run/slurmd-*.pid "$S/run/slurmctld.pid" "$S/run/slurmdbd.pid" "$S/run/mysql.pid" "$S/run/munge/munged.pid"; do
  [ -f "$f" ] || continue
  p=$(cat "$f")
  kill "$p" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$p" 2>/dev/null && kill -9 "$p"
  rm -f "$f"
done
if [ "${1:-}" = "--wipe" ]; then rm -rf "$S/spool" "$S/mysql" "$S/run" "$S/log"; fi
echo "stop.sh: stopped ($S)"
