#!/bin/bash
# Start a real Slurm cluster on this host: munge, MariaDB + slurmdbd (for sacct), slurmctld and four slurmd
# as emulated nodes n1..n4. Idempotent (exits 0 at once when it is already up); waits until all nodes are idle.
#
# Usage: launchers/slurm_local/start.sh [--no-dbd] [--no-install]
#   --no-dbd      no accounting: starts in ~0.1 s instead of ~2.5 s, but sacct (and submitit's job.state) fail
#   --no-install  do not apt-get install missing packages
# State (configs, spool, logs, database, PID files) lives in $SCALEOUT_SLURM_STATE (default /tmp/scaleout-slurm),
# never in the repo. Clients need `export SLURM_CONF=$SCALEOUT_SLURM_STATE/etc/slurm.conf`.
# The state folder must be root's and writable by nobody else; a non-empty folder without scaleout's marker
# is refused (common.sh). n1..n4 are added to $SCALEOUT_SLURM_HOSTS (default /etc/hosts) as one marked line,
# which stop.sh removes.
# Ports: SCALEOUT_SLURM_CTLD_PORT (6817), _DBD_PORT (6819), _DB_PORT (13306), _NODE_PORT (17001..17004).
# Daemons start with fd 9 (the lock) closed, else they would hold the lock forever.
# Stop with launchers/slurm_local/stop.sh (by PID). Needs root (Slurm/munge daemons, /etc/hosts).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
S=${SCALEOUT_SLURM_STATE:-/tmp/scaleout-slurm}
S=${S%/}
# shellcheck source=common.sh
. "$HERE/common.sh"
DBD=1; INSTALL=1
for a in "$@"; do
  case $a in
    --no-dbd) DBD=0 ;;
    --no-install) INSTALL=0 ;;
    *) echo "start.sh: unknown option '$a' (expected --no-dbd or --no-install)" >&2; exit 2 ;;
  esac
done
case "$S/" in "$(cd "$HERE/../.." && pwd)"/*) echo "start.sh: SCALEOUT_SLURM_STATE=$S is inside the repo; pick a folder outside it" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "start.sh: needs root (munged, slurmd, /etc/hosts)" >&2; exit 2; }

# The state folder: created here (root's, 0711: munged wants every folder above its socket searchable by
# all) or checked; always checked again after mkdir, which would not fail on a folder planted meanwhile.
if [ ! -e "$S" ] && [ ! -L "$S" ]; then
  (umask 022; mkdir -p "$(dirname "$S")") && mkdir -m 0711 "$S" && NEWSTATE=1
fi
check_state_dir "$S"
if ! has_marker; then
  # New, empty but for the test sessions' leases (tests/slurmutil.py), or left by an earlier start.sh.
  if [ -n "${NEWSTATE:-}" ] || [ -z "$(ls -A "$S" | grep -vxE 'leases|\.lock')" ] || legacy_state; then
    write_marker
  else
    die2 "state folder $S is not empty and has no $MARKER: not a scaleout Slurm state folder (pick a new or empty folder)"
  fi
fi

missing=""
command -v munged >/dev/null || missing="$missing munge"
command -v slurmctld >/dev/null || missing="$missing slurmctld slurm-client"
command -v slurmd >/dev/null || missing="$missing slurmd"
if [ $DBD = 1 ]; then
  command -v slurmdbd >/dev/null || missing="$missing slurmdbd"
  command -v mariadbd >/dev/null || missing="$missing mariadb-server"
fi
# runc: srun --container=<bundle> (oci.conf below); optional, so only installed when installing anyway
if [ $INSTALL = 1 ] && ! command -v runc >/dev/null; then missing="$missing runc"; fi
if [ -n "$missing" ]; then
  [ $INSTALL = 1 ] || { echo "start.sh: missing packages:$missing (run without --no-install or scripts/setup.sh --test)" >&2; exit 3; }
  echo "start.sh: apt-get install$missing"
  export DEBIAN_FRONTEND=noninteractive
  # postinst cannot start services here (no systemd): expected, this script starts them.
  mkdir -p "$S/log"
  apt-get install -y -q --no-install-recommends $missing >"$S/log/apt.log" 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $missing >>"$S/log/apt.log" 2>&1; } \
    || { echo "start.sh: apt-get install failed, see $S/log/apt.log" >&2; exit 3; }
fi
# srun --mpi=pmix needs libpmix.so, libpmix-dev's link to libpmix2 (pmi2 is built into Slurm). Without it only
# --mpi=pmix steps fail ("can not load PMIx library"), so a failed install is a warning. A running slurmd
# needs no restart: every step's slurmstepd loads the library.
if [ $INSTALL = 1 ] && command -v dpkg-query >/dev/null \
  && ! dpkg-query -W -f='${Status}' libpmix-dev 2>/dev/null | grep -q "ok installed"; then
  mkdir -p "$S/log"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libpmix2 libpmix-dev >>"$S/log/apt.log" 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libpmix2 libpmix-dev >>"$S/log/apt.log" 2>&1; } \
    || echo "start.sh: warning: apt-get install libpmix2 libpmix-dev failed (see $S/log/apt.log): srun --mpi=pmix will not work" >&2
fi

exec 9>"$S/.lock"
flock -w 120 9 || { echo "start.sh: another start/stop holds $S/.lock" >&2; exit 4; }

export SLURM_CONF=$S/etc/slurm.conf
NODES="n1 n2 n3 n4"
all_idle() { [ "$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; }

# Already up? (every daemon's PID file names that daemon of this folder, and sinfo answers)
up=1
for f in "$S/run/slurmctld.pid" "$S"/run/slurmd-n{1,2,3,4}.pid "$S/run/munge/munged.pid"; do alive "$f" || up=0; done
if [ $up = 1 ] && sinfo -h >/dev/null 2>&1; then
  echo "start.sh: already running (SLURM_CONF=$SLURM_CONF)"; exit 0
fi

hosts_add

mkdir -p "$S/etc" "$S/munge" "$S/run/munge" "$S/spool/ctld" "$S/log" "$S/mysql"
for n in $NODES; do mkdir -p "$S/spool/d/$n" "$S/tmp/$n"; done   # pre-created: else "Domain socket directory" noise; tmp: TmpFS
chmod 700 "$S/munge"; chmod 755 "$S/run/munge"          # munged insists the socket dir is o+x
HOST=$(hostname -s)
NP=${SCALEOUT_SLURM_NODE_PORT:-17001}
render() {
  sed -e "s|@STATE@|$S|g" -e "s|@HOST@|$HOST|g" \
      -e "s|@CTLD_PORT@|${SCALEOUT_SLURM_CTLD_PORT:-6817}|g" -e "s|@DBD_PORT@|${SCALEOUT_SLURM_DBD_PORT:-6819}|g" \
      -e "s|@DB_PORT@|${SCALEOUT_SLURM_DB_PORT:-13306}|g" -e "s|@KILL_WAIT@|${SCALEOUT_SLURM_KILL_WAIT:-30}|g" \
      -e "s|@NODE_PORT_1@|$NP|g" -e "s|@NODE_PORT_2@|$((NP + 1))|g" \
      -e "s|@NODE_PORT_3@|$((NP + 2))|g" -e "s|@NODE_PORT_4@|$((NP + 3))|g" "$1" > "$2"
}
render "$HERE/slurm.conf.in" "$S/etc/slurm.conf"
render "$HERE/slurmdbd.conf.in" "$S/etc/slurmdbd.conf"
render "$HERE/gres.conf.in" "$S/etc/gres.conf"
PY=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null || echo python3)  # slurmstepd's PATH has no pyenv shims
sed -e "s|@PYTHON@|$PY|g" -e "s|@HERE@|$HERE|g" "$HERE/oci.conf.in" | render /dev/stdin "$S/etc/oci.conf"  # srun --container (runc)
mkdir -p "$S/run/oci"
mkdir -p "$S/dev"
for i in 0 1 2 3 4 5 6 7; do
  [ -c "$S/dev/gpu$i" ] || mknod "$S/dev/gpu$i" c 1 3 || { echo "start.sh: mknod $S/dev/gpu$i failed (emulated GPUs need it)" >&2; exit 1; }
done
chmod 600 "$S/etc/slurmdbd.conf"   # slurmdbd reads dirname($SLURM_CONF)/slurmdbd.conf and wants 0600

fail() { echo "start.sh: $1" >&2; for l in "$S"/log/*; do echo "--- $l"; tail -n 5 "$l"; done >&2; exit 1; }

[ -f "$S/munge/munge.key" ] || { dd if=/dev/urandom of="$S/munge/munge.key" bs=1024 count=1 2>/dev/null; chmod 400 "$S/munge/munge.key"; }
alive "$S/run/munge/munged.pid" || munged --key-file="$S/munge/munge.key" --socket="$S/run/munge/munge.socket" \
  --pid-file="$S/run/munge/munged.pid" --log-file="$S/log/munged.log" --seed-file="$S/munge/munged.seed" 9>&-

if [ $DBD = 0 ]; then
  sed -i 's|^AccountingStorageType=.*|AccountingStorageType=accounting_storage/none|' "$SLURM_CONF"
else
  DB_PORT=${SCALEOUT_SLURM_DB_PORT:-13306}
  if [ ! -d "$S/mysql/data/mysql" ]; then
    mariadb-install-db --user=root --datadir="$S/mysql/data" --auth-root-authentication-method=socket \
      >"$S/log/mysql-install.log" 2>&1 || fail "mariadb-install-db failed"
    NEWDB=1
  fi
  if ! alive "$S/run/mysql.pid"; then
    setsid -f mariadbd --user=root --datadir="$S/mysql/data" --socket="$S/run/mysql.sock" --pid-file="$S/run/mysql.pid" \
      --bind-address=127.0.0.1 --port="$DB_PORT" --log-error="$S/log/mysql.err" </dev/null >/dev/null 2>&1 9>&-
  fi
  for _ in $(seq 150); do mariadb-admin -S "$S/run/mysql.sock" -u root ping >/dev/null 2>&1 && break; sleep 0.2; done
  mariadb-admin -S "$S/run/mysql.sock" -u root ping >/dev/null 2>&1 || fail "MariaDB did not answer within 30 s"
  if [ -n "${NEWDB:-}" ]; then
    mariadb -S "$S/run/mysql.sock" -u root -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  fi
  alive "$S/run/slurmdbd.pid" || slurmdbd 9>&-
  for _ in $(seq 150); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.2; done
  # slurmctld refuses to start ("no TRES") until the cluster exists; `add` fails when it already does.
  sacctmgr -i add cluster local >/dev/null 2>&1 || true
fi

alive "$S/run/slurmctld.pid" || slurmctld -f "$SLURM_CONF" 9>&-
for n in $NODES; do alive "$S/run/slurmd-$n.pid" || slurmd -f "$SLURM_CONF" -N "$n" 9>&-; done
# After a (re)start the nodes are "unk" for a moment; jobs submitted then wait. Max 30 s. Nodes drained in
# saved state (e.g. by an earlier config) are resumed once.
for i in $(seq 150); do
  all_idle && break
  if [ "$i" = 15 ] && sinfo -h -o '%T' 2>/dev/null | grep -qE 'drain|down|inval'; then
    scontrol update nodename=n[1-4] state=resume >/dev/null 2>&1 || true
  fi
  sleep 0.2
done
all_idle || fail "nodes not idle after 30 s: $(sinfo -h -N -o '%N=%T' 2>&1 | tr '\n' ' ')"
echo "start.sh: up: 4 nodes idle (SLURM_CONF=$SLURM_CONF)"
