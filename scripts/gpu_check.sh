#!/usr/bin/env bash
# Everything on the GPU machine in ONE call: tests at realistic sizes, compute-sanitizer on a
# small decode, scheduler timing, the side-by-side benchmark. Short summary printed last.
#   bash scripts/gpu_check.sh [tests|bench|all] [bench args...]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
MODE=${1:-all}
shift || true
if ls .whl/*.whl >/dev/null 2>&1; then  # peers (FlashInfer) carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=12 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ $MODE == tests || $MODE == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -25
  summary+=("pytest: $(tail -1 "$OUT/pytest.log")")
  compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/sanitize_decode.py \
    >"$OUT/sanitizer.log" 2>&1
  summary+=("sanitizer (rc $?): $(grep -E 'ERROR SUMMARY|rel err' "$OUT/sanitizer.log" | tr '\n' ' ')")
  python3 benchmarks/bench_schedule.py 2>&1 | tee "$OUT/schedule.md"
fi

if [[ $MODE == bench || $MODE == all ]]; then
  python3 -m pagedattn bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
  summary+=("bench rc ${PIPESTATUS[0]}")
fi

echo "================ summary"
printf '%s\n' "${summary[@]}"
