#!/usr/bin/env bash
# Install what scaleout needs. Idempotent; fast when everything is already there.
#   scripts/setup.sh          scaleout (editable) + the mpi, slurm, plot, data, tb extras
#   scripts/setup.sh --test   also the test/bench/dev/dali extras, the Open MPI wheel (mpi-local) and the system
#                             packages the tests use (Slurm, munge, MariaDB for sacct, PMIx for
#                             srun --mpi=pmix, iproute2 for netns)
#   scripts/setup.sh --cpu    pin torch 2.13.0, the CPU build, even over another CPU torch (CI=true does too)
# torch: an installed CUDA torch (an NGC container's own build) is never replaced, and any other installed
# torch is kept unless --cpu / CI=true. torch 2.13.0 is installed when there is none (pinned through
# constraints.txt, so pip never resolves an unpinned multi-GB CUDA build). A failed install fails the script.
# SCALEOUT_SETUP_DRY_RUN=1 prints the torch decision and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
want_cpu=0
for arg in "$@"; do
  case $arg in
    --test) want_test=1 ;;
    --cpu) want_cpu=1 ;;
    *) echo "scripts/setup.sh: unknown option $arg (expected --test, --cpu)" >&2; exit 2 ;;
  esac
done
[ "${CI:-}" = "true" ] && want_cpu=1

info=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>/dev/null) || info=""
tv=${info% *}
tcuda=${info#* }
if [ -z "$info" ]; then
  plan=install why="no torch installed"
elif [ "$tcuda" != none ]; then
  plan=keep why="CUDA build $tv (CUDA $tcuda) is never replaced"
elif [ $want_cpu = 1 ] && [ "${tv%%+*}" != 2.13.0 ]; then
  plan=install why="CPU torch $tv, pinned to 2.13.0 on CI / with --cpu"
else
  plan=keep why="torch $tv"
fi
echo "[setup] torch: $plan ($why)"
[ "${SCALEOUT_SETUP_DRY_RUN:-0}" = 1 ] && exit 0

# constraints.txt pins torch and the test/dev tools (a fresh venv gets what CI got). Keeping another torch:
# the same pins with that torch's version, so pip neither resolves another torch nor drops the tool pins.
constraints=constraints.txt
if [ $plan = keep ] && [ "${tv%%+*}" != 2.13.0 ]; then
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  { grep -v '^torch==' constraints.txt; echo "torch==$tv"; } >"$constraints"
fi
# Only the noise is filtered; with pipefail a failing pip still fails the script.
quiet() { grep -v -e "is ignored: it is neither" -e "Running pip as the 'root'" || true; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check -c "$constraints" "$@" 2>&1 | quiet; }

if [ $plan = install ]; then
  echo "[setup] installing torch 2.13.0 (CPU build)"
  pip_install torch==2.13.0
fi
# mpi-local brings the Open MPI wheel (mpiexec in the venv); on a cluster use its MPI module and plain 'mpi'.
extras="mpi,slurm,plot,data,tb"
# dali: nvidia-dali-cuda120 (a 424 MB wheel, ~1 GB installed with its nvImageCodec/nvJPEG/nvCOMP wheels)
# so that the data.decode=dali tests run on DALI's CPU back-end instead of skipping.
[ $want_test = 1 ] && extras="mpi-local,slurm,plot,data,tb,bench,dev,dali,test"
stamp=".setup-stamp-$extras"
# Ask from outside the checkout (cd /): from inside it, the current directory is on sys.path and would hide a
# missing or stale editable install (for example one that points at a deleted clone).
installed_at() { (cd / && "$PY" -c 'import scaleout,os;print(os.path.dirname(os.path.dirname(os.path.abspath(scaleout.__file__))))' 2>/dev/null) || true; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ] \
  || [ "$(installed_at)" != "$PWD" ]; then
  echo "[setup] installing scaleout[$extras] (editable)"
  pip_install -e ".[$extras]"
  [ "$(installed_at)" = "$PWD" ] || { echo "[setup] error: scaleout is not importable from $PWD after the install" >&2; exit 1; }
  touch "$stamp"
fi
# Bytecode for the checkout, as pip writes it for an installed wheel: an editable install has none, and
# where PYTHONDONTWRITEBYTECODE=1 (this kind of machine sets it) no process writes any, so every rank
# compiled its ~170 scaleout modules from source at each start (~0.4 s of CPU a process). compileall
# writes it regardless; a file edited afterwards is compiled in memory, as before. Seconds, once.
"$PY" -m compileall -q -j 0 scaleout launchers tests >/dev/null 2>&1 || true

# configs/resnet_cpu.yaml trains on the real Fashion-MNIST images (Debian's dataset-fashion-mnist, 30 MB:
# /usr/share/datasets/fashion-mnist/*-ubyte.gz); `scaleout data prepare-fashion-mnist` writes them as images.
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] apt-get install dataset-fashion-mnist"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/tmp/scaleout-apt.log 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends dataset-fashion-mnist >>/tmp/scaleout-apt.log 2>&1; } \
      || echo "[setup] warning: apt-get install dataset-fashion-mnist failed (see /tmp/scaleout-apt.log); configs/resnet_cpu.yaml needs it"
  else
    echo "[setup] not root: skipping apt-get install dataset-fashion-mnist (configs/resnet_cpu.yaml needs it)"
  fi
fi

if [ $want_test = 1 ]; then
  pkgs=""
  command -v slurmctld >/dev/null || pkgs="$pkgs slurm-wlm"
  command -v munged >/dev/null || pkgs="$pkgs munge"
  command -v slurmdbd >/dev/null || pkgs="$pkgs slurmdbd"
  command -v mariadbd >/dev/null || pkgs="$pkgs mariadb-server"
  command -v ip >/dev/null || pkgs="$pkgs iproute2"
  # srun --container=<bundle> (Slurm's OCI containers): the local cluster's oci.conf runs runc, Debian's
  # package as Slurm's (crun 1.8 refuses a hybrid cgroup v1/v2 host).
  command -v runc >/dev/null || pkgs="$pkgs runc"
  # srun --mpi=pmix: Slurm's PMIx plugin loads libpmix.so, the link libpmix-dev adds to libpmix2 (without it
  # `srun --mpi=list` still lists pmix, but every step fails: "can not load PMIx library"). No slurmd
  # restart: each step's slurmstepd loads it.
  if command -v dpkg-query >/dev/null \
    && ! dpkg-query -W -f='${Status}' libpmix-dev 2>/dev/null | grep -q "ok installed"; then
    pkgs="$pkgs libpmix2 libpmix-dev"
  fi
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
