#!/usr/bin/env bash
# The one prepared GPU run (issue 36 A.2 and item 4): on the GPU machine, from the repository root,
# with the kit carried (.gpukit, made by tests/gpu/kit):
#
#     bash tests/gpu/run_all.sh                  # the real GPU: NVML inventory, CUDA
#     bash tests/gpu/run_all.sh --simulate       # here: gpulease up --simulate 1xA100-80GB
#                                                # (or GPULEASE_GPU_RUN_SIMULATE=1; SPEC as 2nd arg)
#
# Steps, each under its own time limit and all inside GPULEASE_GPU_RUN_BUDGET seconds (460: the
# run must end inside 8 minutes); a failed step is reported and the next one runs:
#   install           the kit's wheels, offline, into a --target folder (GPU mode only)
#   kit_check         the image's packages against what the kit asks of them; the imports
#   checkpoint_probe  the driver's checkpoint API on a torch process (tests/gpu/checkpoint_probe.py)
#   notebook          gpulease up + a real notebook through nbclient (tests/gpu/gpu_run.py)
#   drain_check       tests/gpu/drain_check.py (GPU mode only)
#   slices            tests/gpu/test_slices_gpu.py (GPU mode only)
# Writes to $OUT (default ./gpu-run-out): report.json (every figure), run_all.log, notebook.ipynb,
# up.log and logs.tar.gz (each step's log, the Ray and server logs). Exit status 0 when every step did.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
SIM=""
if [ "${1:-}" = "--simulate" ]; then
    SIM=${2:-1xA100-80GB}
elif [ -n "${GPULEASE_GPU_RUN_SIMULATE:-}" ] && [ "${GPULEASE_GPU_RUN_SIMULATE}" != 0 ]; then
    SIM=1xA100-80GB
    [ "$GPULEASE_GPU_RUN_SIMULATE" = 1 ] || SIM=$GPULEASE_GPU_RUN_SIMULATE
fi
OUT=${OUT:-$ROOT/gpu-run-out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpulease-run-all.XXXXXX)
# (what matters of it is in $OUT/logs.tar.gz: tarred here too when the run is stopped before its end)
# and the step then running and the notebook step's gpulease up (its own session) are stopped, not
# left holding the GPU for a second run on the same machine
STEP_PG=""
trap '[ -n "$STEP_PG" ] && kill -TERM -- "-$STEP_PG" 2>/dev/null; stop_up; [ -f "$OUT/logs.tar.gz" ] || tar czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null; rm -rf "$WORK"' EXIT
BUDGET=${GPULEASE_GPU_RUN_BUDGET:-460}
PY=${GPULEASE_GPU_RUN_PYTHON:-python3}
START=$SECONDS
export PYTHONUNBUFFERED=1

step() { # NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, what is left), its output in WORK/NAME.log
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START) - 15))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "== $name: skipped, ${left}s left of ${BUDGET}s"
        echo "{\"rc\": null, \"skipped\": \"no time left\"}" >"$WORK/$name.step.json"
        return
    fi
    echo "== $name (limit ${limit}s, $((SECONDS - START))s into the run)"
    local t0=$SECONDS rc tpid
    # To a file, not through a pipe: a child the step leaves behind (a CUDA process of a failed
    # check) would hold a pipe open, and the run would wait for it until the device's limit.
    # timeout is its process group's leader: what is left in that group is killed after the step.
    timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1 &
    tpid=$!
    STEP_PG=$tpid
    wait "$tpid"
    rc=$?
    kill -KILL -- "-$tpid" 2>/dev/null
    STEP_PG=""
    cat "$WORK/$name.log"
    local timed_out=false
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && timed_out=true
    echo "{\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit, \"timed_out\": $timed_out}" >"$WORK/$name.step.json"
    echo "== $name: rc $rc after $((SECONDS - t0))s"
}

absent() { # NAME WHY: a step that does not apply in this mode
    "$PY" - "$WORK/absent.json" "$1" "$2" <<'EOF'
import json, sys, os
p, name, why = sys.argv[1:]
d = json.load(open(p)) if os.path.exists(p) else {}
d[name] = why
json.dump(d, open(p, "w"))
EOF
}

stop_up() { # the notebook step's `gpulease up` (its own session), if its step could not stop it
    local pid
    pid=$(cat "$WORK/nb/up.pid" 2>/dev/null) || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    echo "stopping gpulease up ($pid), left running by the notebook step"
    kill -INT "$pid"
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null
}

main() {
    echo "gpulease GPU run: $([ -n "$SIM" ] && echo "simulate $SIM" || echo "real GPU"), budget ${BUDGET}s, work $WORK, out $OUT"
    if [ -z "$SIM" ]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,persistence_mode,compute_mode --format=csv >"$WORK/nvidia-smi.log" 2>&1
        { uname -r; free -g; nproc; } >>"$WORK/nvidia-smi.log" 2>&1
        cat "$WORK/nvidia-smi.log"
        local site=/tmp/gpulease-kit-site
        rm -rf "$site"
        step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpukit/*.whl
        export PYTHONPATH="$site:$ROOT" PATH="$site/bin:$PATH"
        step kit_check 30 "$PY" tests/gpu/run_report.py check-kit .gpukit "$WORK/kit_check.json"
    else
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
        absent kit_check "simulate mode: this machine's own environment ($PY), no kit installed"
    fi
    step checkpoint_probe 60 "$PY" tests/gpu/checkpoint_probe.py --json "$WORK/probe.json"
    step notebook 240 "$PY" tests/gpu/gpu_run.py --out "$WORK/nb" ${SIM:+--simulate "$SIM"}
    stop_up
    if [ -z "$SIM" ]; then
        step drain_check 60 "$PY" tests/gpu/drain_check.py
        step slices 120 "$PY" -m pytest -q -x -p no:cacheprovider -o addopts= --timeout 110 tests/gpu/test_slices_gpu.py
    else
        absent drain_check "simulate mode: the drain check needs NVML and CUDA"
        absent slices "simulate mode: tests/gpu/test_slices_gpu.py needs NVML and CUDA"
    fi
    "$PY" tests/gpu/run_report.py merge "$WORK" "$OUT/report.json" "$([ -n "$SIM" ] && echo simulate || echo gpu)"
    for f in notebook.ipynb up.log; do [ -f "$WORK/nb/$f" ] && cp "$WORK/nb/$f" "$OUT/$f"; done
    local home
    home=$(ls -d /tmp/gpulease-gpu-run-*/home 2>/dev/null | tail -1)
    tar czf "$OUT/logs.tar.gz" -C "$WORK" . ${home:+-C "$home" up.log ray.log ray-logs} 2>/dev/null || true
    [ -n "$home" ] && rm -rf "$(dirname "$home")"  # the notebook step's gpulease up home
    echo "done in $((SECONDS - START))s: $OUT/report.json"
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print('failed steps:', r['failed_steps'] or 'none'); print('notebook errors:', r['notebook_errors'] or 'none')" "$OUT/report.json"
}

main 2>&1 | tee "$OUT/run_all.log"
"$PY" -c "import json,sys; sys.exit(1 if json.load(open(sys.argv[1]))['failed_steps'] else 0)" "$OUT/report.json" 2>/dev/null
