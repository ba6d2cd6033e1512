#!/usr/bin/env bash
# The GPU check: one command, at most 8 minutes on one H100/H200 ($DEADLINE seconds, default 470, and the
# wheels' install); a stage that does not fit in what is left is reported as skipped.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]        (default: benchmarks/published/gpu)
#
# Runs, with the torch the machine already has (python3, or $PYTHON):
#   unit    the unit suite (the CPU lane: CUDA hidden), in the background on cores of its own
#   lane    the cuda lane (tests/cuda: CUDA paths, pytest -m cuda)
#   demo    the GPT demo with its own defaults (examples/gpt/train.py)
#   step_path benchmarks/step_path.py: the trainer against a hand-written loop, eager and compiled, MFU
#   compile benchmarks/compile.py: eager against compiled, by strategy and size
#   fp8     benchmarks/fp8.py: float8 against bf16 (mlp, Llama blocks), and the matmul sweep
#   compile_profile  (not run unless named in STAGES) the ops tables of eager and compiled at two sizes
# STAGES="lane demo" (space-separated) runs only those; STEP_ARGS, FP8_ARGS, COMPILE_ARGS and PROFILE_ARGS replace
# (COMPILE_ARGS, PROFILE_ARGS) or extend those benchmarks' arguments, UNIT_TESTS the unit tests' paths. Each stage's output goes to
# RESULTS_DIR/<stage>.log, each benchmark's JSON to RESULTS_DIR/<name>.json (what
# docs/benchmarks.md quotes, with the machine, device and versions inside). Optional packages
# missing on the machine (torchao, torchdata, tyro, torchft, ...) are installed from wheels in
# .whl/ beside the checkout ($WHEELS) when there are any (pip install --no-index --no-deps --target;
# scripts/gpu_wheels.sh fetches them, on a machine with the registry).
# A stage that fails is reported and the others still run; the exit status is the number of
# failed stages. Where $OUT is set (a lent device machine), everything is also packed into
# $OUT/gpu_check.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${1:-benchmarks/published/gpu}
STAGES=${STAGES:-"unit lane demo step_path compile fp8"}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1

WHEELS=${WHEELS:-.whl}
if ! "$PY" -c "import torchao, torchdata, tyro, torchft, xxhash" 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d /tmp/dt_site.XXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl || exit 99
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

cores=$(nproc)
half=$((cores / 2))
gpu_cores="0-$((half > 1 ? half - 1 : 0))"
cpu_cores="$half-$((cores - 1))"
pin_gpu=()
pin_cpu=()
if [ "$cores" -ge 8 ] && command -v taskset >/dev/null; then  # the GPU stages and the CPU lane on separate cores
  pin_gpu=(taskset -c "$gpu_cores")
  pin_cpu=(taskset -c "$cpu_cores")
fi

{
  date
  nvidia-smi -L 2>&1
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
    [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())])"
  "$PY" -c "import torchao, tyro, torchft; print('torchao', torchao.__version__, 'tyro', tyro.__version__)" 2>&1 | tail -1
  # Said up front, not found as test errors minutes later: an optional package that still does not import
  # (scripts/gpu_wheels.sh fetches the whole set, dependencies included). The stages that need none still run.
  for mod in torchao torchdata tyro torchft xxhash; do
    err=$("$PY" -c "import $mod" 2>&1 | tail -1) || echo "WARNING: import $mod fails: $err (scripts/gpu_wheels.sh fetches the wheels)"
  done
} | tee "$RESULTS/environment.txt"

failed=0
summary=()
DEADLINE=${DEADLINE:-470}  # seconds for the whole check: a stage gets at most what is left
pack() {  # after every stage: what is done so far comes back even if a later stage is cut short
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then tar czf "$OUT/gpu_check.tgz" -C "$RESULTS" . 2>/dev/null; fi
}
stage() {  # stage NAME TIMEOUT CMD...: run, log, record
  local name=$1 limit=$2
  shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then summary+=("$(printf '%-8s skipped: no time left' "$name")"); return 0; fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  tail -n "${TAIL:-25}" "$RESULTS/$name.log"
  pack
}

unit_pid=
case " $STAGES " in *" unit "*)
  "${pin_cpu[@]}" timeout "$DEADLINE" "$PY" -m pytest ${UNIT_TESTS:-tests/unit} -q -p no:cacheprovider >"$RESULTS/unit.log" 2>&1 &
  unit_pid=$!
  unit_t0=$SECONDS ;;
esac

stage lane 200 "${pin_gpu[@]}" "$PY" -m pytest tests/cuda -m cuda -q -rs -p no:cacheprovider
stage demo 90 "${pin_gpu[@]}" "$PY" examples/gpt/train.py --root-dir /tmp/gpu_check_demo
stage step_path 180 "${pin_gpu[@]}" "$PY" benchmarks/step_path.py ${STEP_ARGS:-} --out "$RESULTS/step_path.json"
stage fp8 300 "${pin_gpu[@]}" "$PY" benchmarks/fp8.py --rounds 1 ${FP8_ARGS:-} --out "$RESULTS/fp8.json"
stage compile 300 "${pin_gpu[@]}" "$PY" benchmarks/compile.py ${COMPILE_ARGS:---rounds 1 --sizes demo,wide-bf16,large-bf16 \
  --strategies eager,demo,demo-nographs} --out "$RESULTS/compile.json"
stage compile_profile 240 "${pin_gpu[@]}" "$PY" benchmarks/compile.py ${PROFILE_ARGS:---rounds 1 --sizes demo,large-bf16 \
  --strategies eager,demo} --profile --out "$RESULTS/compile_profile.json"

if [ -n "$unit_pid" ]; then
  wait "$unit_pid"
  rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss' unit "$rc" "$((SECONDS - unit_t0))")")
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  echo "=== unit"
  tail -n 8 "$RESULTS/unit.log"
fi

echo "=== summary ($failed failed)"
printf '%s\n' "${summary[@]}" | tee "$RESULTS/summary.txt"
pack
exit "$failed"
