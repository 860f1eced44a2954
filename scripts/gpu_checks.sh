#!/usr/bin/env bash
# The GPU checks in one run, on a GPU host whose python3 has torch with CUDA:
# the GPU tier, the rest of the suite with CPU ranks, and bench/gpu_step.py.
#
#   bash scripts/gpu_checks.sh [OUT_DIR]       # OUT_DIR defaults to $OUT, else ./gpu-checks
#   STEPS="gpu-tier bench" bash scripts/gpu_checks.sh OUT_DIR   # some steps only
#
# The steps' limits add up to more than a device session's 600 s per
# command: run "gpu-tier bench" in one command and "suite" in another (with
# DeepSpeed's runners in the bench, its limit is 540 s: "bench" in one and
# "gpu-tier suite" in the other).
#
# A host without network access gets what it lacks (paramiko and its
# dependencies; DeepSpeed 0.19.8 and its dependencies for the DeepSpeed
# anchors) as wheels for that host's python3 in WHEELS (default ./.whl; how
# to build them: the README's "Tests"). Every wheel but DeepSpeed's goes into
# a scratch directory (GPU_SITE) on every step's PYTHONPATH; DeepSpeed's own
# wheel goes into a second one (GPU_SITE_DS) on the bench step's PYTHONPATH
# only: with a real deepspeed importable, dsrun's `deepspeed` alias steps
# aside, and the suite's alias tests would test DeepSpeed instead. The bench
# step adds DeepSpeed's runners (ds-*) to its list when deepspeed imports
# there. Each step has a time limit (GPU_TIER_S, SUITE_S, BENCH_S seconds) so
# that one run fits a session's device time; every step's output goes to
# OUT_DIR and a summary line per step to stdout. Exits non-zero when a step
# failed.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-checks}}
mkdir -p "$out"
steps=" ${STEPS:-gpu-tier suite bench} "
for name in $steps; do
    case $name in gpu-tier|suite|bench) ;; *) echo "gpu-checks: unknown step $name in STEPS (gpu-tier, suite, bench)" >&2; exit 2;; esac
done
python3 -c "import torch; print('torch', torch.__version__)" || exit 2
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu-checks: torch.cuda.is_available() is False here: run this on a GPU host" >&2
    exit 2
fi
wheels=${WHEELS:-.whl}
site=${GPU_SITE:-/tmp/dsrun-gpu-site}
site_ds=${GPU_SITE_DS:-$site-deepspeed}
if [ -d "$site/deepspeed" ]; then  # an older version of this script put it there
    echo "gpu-checks: $site holds deepspeed, which would reach the suite: remove $site" >&2
    exit 2
fi
install() {  # TARGET WHEEL...: one pip call; if it fails, one per wheel, naming the bad ones
    local target=$1 wheel
    shift
    local pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
               --upgrade --target "$target")
    "${pip[@]}" "$@" >> "$out/pip.txt" 2>&1 && return 0
    for wheel in "$@"; do
        "${pip[@]}" "$wheel" >> "$out/pip.txt" 2>&1 ||
            echo "gpu-checks: $wheel did not install (see $out/pip.txt)"
    done
}
shopt -s nullglob
others=() ds_wheels=()
for wheel in "$wheels"/*.whl; do
    case ${wheel##*/} in deepspeed-*) ds_wheels+=("$wheel") ;; *) others+=("$wheel") ;; esac
done
shopt -u nullglob
: > "$out/pip.txt"
[ ${#others[@]} -eq 0 ] || install "$site" "${others[@]}"
[ ${#ds_wheels[@]} -eq 0 ] || install "$site_ds" "${ds_wheels[@]}"
export PYTHONPATH="$site:$PWD"
bench_path="$site_ds:$PYTHONPATH"
export PYTHONUNBUFFERED=1
# 8 test workers of 2 threads each on a 16-core host: more oversubscribes it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
nvidia-smi -L 2>&1 | head -4

status=0
step() {  # NAME LIMIT_S COMMAND...: run, keep the output, print one summary line
    local name=$1 limit=$2 start rc
    [[ $steps == *" $name "* ]] || return 0
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    rc=$?
    echo "gpu-checks: $name rc=$rc in $(( $(date +%s) - start )) s"
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/$name.txt" | tail -15
    [ "$rc" -eq 0 ] || status=1
}

step gpu-tier "${GPU_TIER_S:-200}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu
workers=()
if python3 -c "import xdist" 2> /dev/null; then workers=(-n "${WORKERS:-8}"); fi
step suite "${SUITE_S:-300}" python3 -m pytest -q -p no:cacheprovider "${workers[@]}" -rfEs \
    tests/unit tests/proc tests/dist tests/cluster
runners=torch,torch-fused,dsrun-s0,dsrun-s1,dsrun-s2,dsrun-s3,dsrun-s2-off,dsrun-s3-off
bench_s=240
if [[ $steps == *" bench "* ]] && PYTHONPATH="$bench_path" python3 -c "import deepspeed" 2> /dev/null; then
    # the cpuadam runners JIT-build DeepSpeedCPUAdam (a C++ compiler and ninja needed)
    runners+=,ds-s0,ds-s1,ds-s2,ds-s3,ds-s2-off,ds-s3-off,ds-s2-off-cpuadam,ds-s3-off-cpuadam
    bench_s=540
fi
step bench "${BENCH_S:-$bench_s}" env PYTHONPATH="$bench_path" python3 bench/gpu_step.py \
    --runners "${BENCH_RUNNERS:-$runners}" --json "$out/bench.json"
[[ $steps == *" bench "* ]] && grep -v "done$" "$out/bench.txt" | tail -20
exit "$status"
