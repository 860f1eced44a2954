#!/usr/bin/env bash
# Install everything dsrun needs into ./.venv on a bare Debian machine.
#
# - Debian packages (as root only): sshd/ssh for multi-host jobs and the
#   simulated-cluster tests, Open MPI for mpi4py and --launcher openmpi,
#   iproute2 for namespaces, and Slurm (slurmctld, slurmd, slurm-client)
#   with munge for the tests that run --launcher slurm on a real Slurm
#   (~20 s more; the tests start their own daemons and config).
# - torch is pinned to the CPU build that lies on this machine's disk
#   (TORCH_SPEC overrides it, e.g. TORCH_SPEC=torch for a CUDA machine):
#   an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES="openssh-server openssh-client openmpi-bin libopenmpi-dev iproute2 \
slurmctld slurmd slurm-client munge"
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    missing=""
    for pkg in $APT_PACKAGES; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
    done
    if [ -n "$missing" ]; then
        echo "install.sh: apt-get install$missing"
        # A mirror's passing error or unattended-upgrades holding the dpkg
        # lock must not fail a CI run: retried downloads, a lock wait, and
        # one more try of the index update.
        APT_OPTS="-o Acquire::Retries=3 -o DPkg::Lock::Timeout=120"
        apt-get $APT_OPTS update -qq || { sleep 10; apt-get $APT_OPTS update -qq; }
        DEBIAN_FRONTEND=noninteractive apt-get $APT_OPTS install -y -qq \
            --no-install-recommends $missing >/dev/null
    fi
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Each pip install is tried once more: a slow or flaky index fails a CI run.
pip_install() {
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" || {
        echo "install.sh: pip install $* failed; trying once more" >&2
        sleep 10
        .venv/bin/python -m pip install -q --disable-pip-version-check "$@"
    }
}
pip_install "${TORCH_SPEC:-torch==2.13.0}"
# numpy comes as dsrun's declared dependency (pyproject), as for `pip install dsrun`.
pip_install -e ".[test]"
# dsrun's own release: dsrun.__version__ is the DeepSpeed-compatible string.
echo "install.sh: dsrun $(.venv/bin/python -c 'import dsrun; print(dsrun.DSRUN_VERSION)') installed in .venv"
