#!/usr/bin/env bash
# Install what scaleout needs on a fresh Debian 12 / Python 3.11 machine of this kind. Idempotent; fast
# when everything is already there.
#   scripts/setup.sh          python package + torch 2.13.0 (CPU) + mpi/slurm/plot extras
#   scripts/setup.sh --test   also the test extra and the system packages the tests use (Slurm, munge,
#                             MariaDB for sacct, iproute2 for the emulated cluster)
# pip always runs with -c constraints.txt (torch==2.13.0): an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

pip_install() { "$PY" -m pip install -q --disable-pip-version-check -c constraints.txt "$@"; }

if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU build)"
  pip_install torch==2.13.0
fi
extras="mpi,slurm,plot,data"
[ $want_test = 1 ] && extras="$extras,test"
stamp=".setup-stamp-$extras"
# Ask from outside the checkout (cd /): from inside it, the current directory is on sys.path and would hide a
# missing or stale editable install (for example one that points at a deleted clone).
installed_at() { (cd / && "$PY" -c 'import scaleout,launchers,os;print(os.path.dirname(os.path.dirname(os.path.abspath(scaleout.__file__))))' 2>/dev/null) || true; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(installed_at)" != "$PWD" ]; then
  echo "[setup] installing scaleout[$extras] (editable)"
  pip_install -e ".[$extras]" 2>&1 | grep -v -e "is ignored: it is neither" -e "Running pip as the 'root'" || true
  [ "$(installed_at)" = "$PWD" ] && touch "$stamp"
fi

if [ $want_test = 1 ]; then
  pkgs=""
  command -v slurmctld >/dev/null || pkgs="$pkgs slurm-wlm"
  command -v munged >/dev/null || pkgs="$pkgs munge"
  command -v slurmdbd >/dev/null || pkgs="$pkgs slurmdbd"
  command -v mariadbd >/dev/null || pkgs="$pkgs mariadb-server"
  command -v ip >/dev/null || pkgs="$pkgs iproute2"
  if [ -n "$pkgs" ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "[setup] apt-get install$pkgs"
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q --no-install-recommends $pkgs >/tmp/scaleout-apt.log 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $pkgs >>/tmp/scaleout-apt.log 2>&1; } \
        || echo "[setup] warning: apt-get install failed (see /tmp/scaleout-apt.log); Slurm/netns tests will say why they skip"
    else
      echo "[setup] not root: skipping apt-get install of$pkgs (those tests will skip and say why)"
    fi
  fi
fi
