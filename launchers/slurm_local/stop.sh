#!/bin/bash
# Stop what launchers/slurm_local/start.sh started, by PID file, in reverse order. Cancels running jobs first
# so that no job step survives its slurmd. Usage: launchers/slurm_local/stop.sh [--wipe]
#   --wipe  also delete spool, database and logs (job ids restart at 1; keeps configs and the munge key)
# A PID is signalled only if it is that daemon of this state folder (a stale file never kills a reused PID);
# nothing is done in a folder that is not root's or lacks scaleout's marker (common.sh). Removes the line
# start.sh added to the hosts file.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
S=${SCALEOUT_SLURM_STATE:-/tmp/scaleout-slurm}
S=${S%/}
# shellcheck source=common.sh
. "$HERE/common.sh"
WIPE=0
for a in "$@"; do
  case $a in
    --wipe) WIPE=1 ;;
    *) echo "stop.sh: unknown option '$a' (expected --wipe)" >&2; exit 2 ;;
  esac
done
[ -e "$S" ] || [ -L "$S" ] || { echo "stop.sh: nothing at $S"; exit 0; }
check_state_dir "$S"
if ! has_marker; then
  legacy_state || die2 "state folder $S has no $MARKER: not a scaleout Slurm state folder, left alone"
  write_marker
fi
exec 9>"$S/.lock"
flock -w 120 9 || { echo "stop.sh: another start/stop holds $S/.lock" >&2; exit 4; }
export SLURM_CONF=$S/etc/slurm.conf
if alive "$S/run/slurmctld.pid"; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
for f in "$S"/run/slurmd-*.pid "$S/run/slurmctld.pid" "$S/run/slurmdbd.pid" "$S/run/mysql.pid" "$S/run/munge/munged.pid"; do
  [ -f "$f" ] || continue
  p=$(cat "$f" 2>/dev/null)
  if alive "$f"; then
    kill "$p" 2>/dev/null || true
    for _ in $(seq 50); do alive "$f" || break; sleep 0.2; done
    alive "$f" && kill -9 "$p"
  elif [ -n "$p" ] && [ -e "/proc/$p" ]; then
    echo "stop.sh: $f names pid $p, which is not $(daemon_of "$f") of $S ($(cat "/proc/$p/comm" 2>/dev/null)): left alone"
  fi
  rm -f "$f"
done
hosts_remove
if [ $WIPE = 1 ]; then rm -rf "$S/spool" "$S/mysql" "$S/run" "$S/log"; fi
echo "stop.sh: stopped ($S)"
