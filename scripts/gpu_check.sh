#!/usr/bin/env bash
# The GPU checks of covey's device paths, in one call (about 8 minutes on an H100/H200):
#   1. scripts/gpu_check.py: device codecs write the host's bytes, the sketch on the GPU agrees
#      with the host's, DiLoCo's device memory, zero host syncs, KV-cache generation;
#   2. `covey bench gpu` at 124M (covey:gpt2) in bf16: covey's inner step vs a bare PyTorch
#      loop, MFU, codec ms per MB;
#   3. a 2-worker DiLoCo run with a validator, every peer on the GPU (`covey demo`).
# Results go under $OUT (default ./gpu-check); BENCHMARKS.md takes the numbers with the
# device named. Run from the repository root: bash scripts/gpu_check.sh
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:-$PWD}
COVEY=("$PY" -m covey)
status=0
step() {  # step NAME SECONDS CMD...: run with a deadline, keep its output, note failures
  local name=$1 secs=$2
  shift 2
  echo "== $name (at most ${secs}s)"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s; tail:"
  tail -n 15 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
step checks 150 "$PY" scripts/gpu_check.py --json "$OUT/checks.json"
step hostsync_tests 90 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_hostsync.py
step round_on_cuda 90 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_device_round.py -k cuda
step bench_gpu 180 "${COVEY[@]}" bench gpu --model covey:gpt2 --device cuda \
  --precision bf16 --no-llama --steps 10 --blocks 4 --json "$OUT/bench_gpu.json"
step demo 200 "${COVEY[@]}" demo --workers 2 --validators 1 --device cuda --model micro \
  --rounds 4 --minutes 3 --no-progress --out "$OUT/demo"
exit $status
