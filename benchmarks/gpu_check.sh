#!/usr/bin/env bash
# Everything a GPU session should run, in one call of at most 8 minutes on one H100/H200, with
# every result in one folder ($OUT when set, as on the device tool's machine, else
# benchmarks/results/gpu_check/):
#   1. the CUDA tests (pytest -m cuda)                    -> gpu_check.log
#   2. CUDA-vs-CPU greedy tokens (eager, DBO, graphs)     -> cuda_vs_cpu_tokens.json
#   3. the `tandem profile` table, deepseek-v2-lite-random -> profile.json (table in the log)
#   4. Engine output tok/s: eager / full graphs / DBO      -> engine_tok_s.json
#   5. the benchmarks/gpu.py sweep (none / dbo / sbo)     -> gpu.json
#   and summary.json: each step's status, exit code and seconds, and issue 30's goals, each
#   with its figure and met / missed / not measured (also printed as the last table).
# Each step has a time limit, the GPU path's limits add up to the budget
# (TANDEM_GPU_CHECK_BUDGET_S, default 360 s: 6 minutes of an 8-minute call, the rest for the
# machine's start and the transfers; tests/bench/test_gpu_check.py keeps the sum), and a step
# that would not fit in what is left is cut to it or skipped, and says so. A failing step
# does not stop the others; the script exits 1 if any step failed.
#
# The GPU image lacks FastAPI, pydantic, greenlet, ...: run benchmarks/gpu_wheels.sh here
# first and carry its folder (.whl, or TANDEM_WHEELS); they are installed offline into
# /tmp/tandem-site. On the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# --cpu (or TANDEM_GPU_CHECK_CPU=1): the same script, quickly, on the CPU: CUDA steps are
# skipped and the others run on tiny sizes (the test suite runs this).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CPU=${TANDEM_GPU_CHECK_CPU:-0}
[ "${1:-}" = "--cpu" ] && CPU=1
DIR=${OUT:-$ROOT/benchmarks/results/gpu_check}
BUDGET=${TANDEM_GPU_CHECK_BUDGET_S:-360}
WHEELS=${TANDEM_WHEELS:-$ROOT/.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
LOG=$DIR/gpu_check.log
STEPS=$(mktemp)
: >"$LOG"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)
failed=0

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$STEPS"; }

# step NAME LIMIT_S CMD...: run CMD with at most LIMIT_S seconds (less if the budget is short).
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 30 ]; then
    say "$name: skipped, ${left}s of the ${BUDGET}s budget left"
    record "$name" skipped "" 0 "out of time"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "$name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]} status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status=failed; fi
  [ "$status" != ok ] && failed=1
  record "$name" "$status" "$rc" $(($(date +%s) - t0)) "$*"
  say "$name: $status (exit $rc, $(($(date +%s) - t0))s)"
}

skip() { say "$1: skipped ($2)"; record "$1" skipped "" 0 "$2"; }

if [ "$CPU" = 1 ]; then
  say "CPU smoke path: CUDA steps skipped, tiny sizes; results in $DIR"
  skip wheels "the CPU environment has tandem's dependencies"
  skip cuda_tests "no GPU"
  skip cuda_vs_cpu_tokens "no GPU"
  step profile 60 "$PY" -m tandem profile --model tiny-moe --device cpu --batch 2 --prompt-len 8 \
    --decode-steps 1 --repeat 1 --json "$DIR/profile.json"
  step engine_tok_s 60 "$PY" benchmarks/engine_tok_s.py --device cpu --model tiny-moe --requests 2 \
    --prompt-len 8 --max-tokens 2 --modes eager,dbo --repeat 1 --warmup 0 --json "$DIR/engine_tok_s.json"
  skip gpu_sweep "benchmarks/gpu.py measures CUDA streams"
else
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    step wheels 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/tandem-site "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/tandem-site"
  else
    skip wheels "no wheels in $WHEELS: run benchmarks/gpu_wheels.sh and carry the folder"
  fi
  nvidia-smi 2>&1 | tee -a "$LOG" | head -15
  # Cold Triton compiles of every kernel on the image's Triton: the longest step.
  step cuda_tests 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/cuda tests/modular_kernels/test_cuda_kernels.py
  step cuda_vs_cpu_tokens 40 "$PY" benchmarks/cuda_vs_cpu_tokens.py --json "$DIR/cuda_vs_cpu_tokens.json"
  step profile 60 "$PY" -m tandem profile --model deepseek-v2-lite-random --device cuda --batch 64 \
    --prompt-len 128 --moe-backend triton --decode-steps 4 --repeat 2 --json "$DIR/profile.json"
  # DBO on one GPU measures its overhead only (nothing to hide): eager and graphs here.
  step engine_tok_s 50 "$PY" benchmarks/engine_tok_s.py --requests 64 --prompt-len 128 --max-tokens 32 \
    --modes eager,graphs --repeat 2 --warmup 1 --json "$DIR/engine_tok_s.json"
  step gpu_sweep 40 "$PY" benchmarks/gpu.py --decode-tokens 64 --prefill-tokens 2048 --modes none,dbo \
    --repeat 3 --warmup 1 --requests 64 --max-tokens 32 --json "$DIR/gpu.json"
fi

"$PY" - "$STEPS" "$DIR/summary.json" "$CPU" "$BUDGET" $(($(date +%s) - START)) "$DIR" <<'PYEOF'
import json, os, sys
steps_file, out, cpu, budget, elapsed, folder = sys.argv[1:]
steps = []
for line in open(steps_file):
    name, status, rc, seconds, detail = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": status, "exit_code": int(rc) if rc else None,
                  "seconds": int(seconds), "detail": detail})
# The device and torch version are in each step's JSON and the log (nvidia-smi): importing
# torch here only for them would cost seconds.
def load(name):
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


from tandem.testing.gpu_goals import gpu_goals, goals_table

goals = gpu_goals(load("profile.json"), load("engine_tok_s.json"), int(elapsed), on_gpu=cpu != "1")
info = {"cpu_smoke": cpu == "1", "budget_s": int(budget), "elapsed_s": int(elapsed), "steps": steps, "goals": goals}
json.dump(info, open(out, "w"), indent=2)
print("\n| step | status | seconds |\n|---|---|---|")
for s in steps:
    print(f"| {s['step']} | {s['status']}{'' if s['exit_code'] in (0, None) else ' (exit %d)' % s['exit_code']} | {s['seconds']} |")
print("\n" + goals_table(goals))
PYEOF
rm -f "$STEPS"
say "done in $(($(date +%s) - START))s; results in $DIR"
exit $failed
