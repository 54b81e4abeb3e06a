#!/usr/bin/env bash
# Everything on a GPU machine in one run: the Hopper family's tests and sweep, the example
# model's decode loop, tests at realistic sizes, compute-sanitizer on a
# small decode, the fuzzer (valid and corrupted steps, also under compute-sanitizer),
# scheduler timing, the offline tuner, the side-by-side benchmark; a short summary printed
# last. Logs go to /tmp/gpu_logs; the results worth keeping go to $RESULTS (default
# /tmp/gpu_check_out).
#   bash scripts/gpu_check.sh [gluon|features|example|tests|fuzz|tune|bench|append|fa3|cb|host|all|
#   steady|robust|repro|quick|sanitize_fuzz|profile|budget|ab|ab_src|ab_multi] [args]
# (several modes in one run: comma-separated, e.g. append,fa3,cb,steady, each with its summary;
# append: append_kv against the copy ceiling, benchmarks/micro.py append; fa3: FlashInfer's FA3
# backend beside pagedattn and XQA, FP8 and bf16 KV (FA3_BENCH_ARGS replace its cases); cb:
# transformers' continuous batching with paged|sdpa and with pagedattn,
# benchmarks/transformers_cb.py (CB_ARGS); these three also in all; steady: examples/generate.py's
# steady-state decode, bf16 and FP8 caches, STEADY_TOKENS new tokens (default 256), with
# STEADY_EAGER=1 also without CUDA graphs; not in all, where example runs generate.py; each
# bounded by APPEND_SECONDS, FA3_SECONDS, CB_SECONDS, STEADY_SECONDS (a run));
# (robust: the suite's corrupted-input fuzz batches, the Hopper family preferred, under
# compute-sanitizer, one process, ROBUST_K / ROBUST_SECONDS; not part of all;
# host: wall time of each eager call, scripts/host_overhead.py, also in all and profile;
# profile: that and the per-program decode trace; not part of all. ab VAR:
# the seed, bf16 and page-16 benchmarks with VAR=0 and VAR=1 in turn, packed into
# $RESULTS/ab.tar.gz; compare the CSVs with scripts/ab_env.py. ab_src DIR: the seed benchmark of
# pagedattn alone with the sources in DIR (a checkout's src/ and benchmarks/, e.g.
# `mkdir .ab_base && git archive REV src benchmarks | tar -x -C .ab_base`) and with these,
# rounds A B, B A, ... (AB_ROUNDS, default 2), compared by scripts/ab_env.py; bench case
# options after DIR replace the seed preset. ab_multi NAME=DIR,NAME=DIR,...: the same for
# several builds, DIR "." this checkout, in one order and then the reverse, AB_ROUNDS times;
# every time also over the first build's, e.g. `scripts/without_checks.py .ab_none`, then
# `ab_multi none=.ab_none,checked=. --query-len 1`)
set -u
export PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-/tmp/gpu_check_out}
LOGS=/tmp/gpu_logs
mkdir -p "$RESULTS" "$LOGS"
MODE=${1:-all}
shift || true
if [[ $MODE == *,* ]]; then
  status=0
  for one in ${MODE//,/ }; do bash "$0" "$one" "$@" || status=$?; done
  exit $status
fi
if ls .whl/*.whl >/dev/null 2>&1; then  # peers (FlashInfer) installed from wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=12 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ $MODE == gluon || $MODE == all ]]; then
  # The Hopper family first: its own tests, then its sweep against the portable family.
  # (time-bounded: a kernel whose roles disagree on a barrier would hang)
  timeout "${GLUON_TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider -x tests/test_gluon.py \
    >"$LOGS/gluon_tests.log" 2>&1
  summary+=("gluon tests: $(tail -1 "$LOGS/gluon_tests.log")")
  grep -E "^(FAILED|ERROR)|Error|error:" "$LOGS/gluon_tests.log" | head -20
  cp "$LOGS/gluon_tests.log" "$RESULTS"/
  timeout "${SWEEP_SECONDS:-240}" python3 benchmarks/micro.py gluon ${GLUON_SWEEP_ARGS:-} \
    >"$RESULTS/micro_gluon.txt" 2>&1
  summary+=("gluon sweep rc $?: $RESULTS/micro_gluon.txt")
  grep -E "^\|" "$RESULTS/micro_gluon.txt" | tail -30
fi

if [[ $MODE == features || $MODE == all ]]; then
  # Each serving feature's cost against the plain step.
  timeout "${FEATURES_SECONDS:-240}" python3 benchmarks/micro.py features >"$RESULTS/features.txt" 2>&1
  summary+=("features rc $?: $RESULTS/features.txt")
  grep -E "^\||failed|WRONG" "$RESULTS/features.txt" | tail -30
fi

if [[ $MODE == example || $MODE == all ]]; then
  # A model's decode loop on pagedattn, both caches (tokens/s against transformers' attention).
  for kv in bf16 fp8; do
    timeout 300 python3 examples/generate.py --kv-cache $kv >"$RESULTS/generate_$kv.txt" 2>&1
    summary+=("generate $kv rc $?: $(tail -3 "$RESULTS/generate_$kv.txt" | tr '\n' ' ')")
  done
fi

if [[ $MODE == tests || $MODE == all ]]; then
  # Compilation dominates: several workers share the GPU (pytest-xdist, where installed).
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-6}")
  timeout "${TESTS_SECONDS:-900}" python3 -m pytest -q -p no:cacheprovider "${workers[@]}" \
    --durations=15 tests \
    >"$LOGS/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$LOGS/pytest.log" | head -20
  summary+=("pytest: $(tail -1 "$LOGS/pytest.log")")
  compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/sanitize_decode.py \
    >"$LOGS/sanitizer.log" 2>&1
  summary+=("sanitizer (rc $?): $(grep -E 'ERROR SUMMARY|rel err' "$LOGS/sanitizer.log" | tr '\n' ' ')")
  cp "$LOGS"/pytest.log "$RESULTS"/
fi

if [[ $MODE == sanitize_fuzz ]]; then
  # compute-sanitizer memcheck over corrupted steps, each family preferred in turn:
  # SANITIZE_PROCS processes a family at once (after a fuzz run has filled Triton's cache,
  # compilation does not run under the sanitizer), SANITIZE_CORRUPT corrupted steps each.
  pids=()
  for backend in ${FUZZ_BACKENDS:-gluon triton}; do
    for i in $(seq 1 "${SANITIZE_PROCS:-4}"); do
      timeout "${SANITIZE_SECONDS:-240}" compute-sanitizer --tool memcheck --print-limit 10 \
        python3 scripts/fuzz.py --valid 3 --corrupt "${SANITIZE_CORRUPT:-55}" --max-batch 8 \
        --max-len 800 --seed "$((100 + i))" --backend "$backend" \
        --seconds "$((${SANITIZE_SECONDS:-240} - 30))" \
        >"$LOGS/sanitize_${backend}_$i.log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for backend in ${FUZZ_BACKENDS:-gluon triton}; do
    # The fuzzer's own lines name the cases; the sanitizer's its errors, per process.
    cat "$LOGS"/sanitize_"${backend}"_*.log >"$RESULTS/sanitize_$backend.log"
    python3 - "$backend" "$LOGS"/sanitize_"${backend}"_*.log <<'PY' | tee -a "$RESULTS/robust_lines.txt"
import re, sys
backend, logs = sys.argv[1], sys.argv[2:]
steps = errors = 0
complete = True
for path in logs:
    text = open(path).read()
    m = re.search(r"^fuzz \(\w+\): .*?(\d+) valid, (\d+) corrupted", text, re.M)
    e = re.search(r"ERROR SUMMARY: (\d+) error", text)
    complete &= bool(m and e)
    steps += int(m.group(2)) if m else 0
    errors += int(e.group(1)) if e else 0
family = {"gluon": "gluon", "triton": "triton"}[backend]
print(f"sanitizer family={family} steps={steps} errors={errors}"
      + ("" if complete else " (a process did not finish)"))
PY
  done
  summary+=("$(tail -2 "$RESULTS/robust_lines.txt" | tr '\n' ' ')")
fi

if [[ $MODE == fuzz || $MODE == all ]]; then
  # 8 workers: 11,000 cases in 136-169 s on the H200 (6 reached 9,600 in 180 s). Once with the
  # default family choice, once preferring the Hopper family wherever it covers a step (each
  # FUZZ_SECONDS, SANITIZE_SECONDS under compute-sanitizer).
  for backend in ${FUZZ_BACKENDS:-auto gluon}; do
    python3 scripts/fuzz.py --valid 10000 --corrupt 1000 --max-batch 16 --max-len 2000 \
      --workers "${FUZZ_WORKERS:-8}" --backend "$backend" --seconds "${FUZZ_SECONDS:-300}" \
      >"$LOGS/fuzz_$backend.log" 2>&1
    summary+=("fuzz (rc $?): $(grep -E '^fuzz' "$LOGS/fuzz_$backend.log")")
    grep -E '^fuzz family=' "$LOGS/fuzz_$backend.log" >>"$RESULTS/robust_lines.txt"
    grep -A12 -m3 Traceback "$LOGS/fuzz_$backend.log" | head -40
    cp "$LOGS/fuzz_$backend.log" "$RESULTS"/
    [[ ${FUZZ_SANITIZE:-1} == 1 ]] || continue  # (sanitize_fuzz: several processes at once)
    compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/fuzz.py --valid 10 \
      --corrupt 400 --max-batch 8 --max-len 600 --seed 1 --backend "$backend" \
      --seconds "${SANITIZE_SECONDS:-150}" >"$LOGS/sanitizer_fuzz_$backend.log" 2>&1
    summary+=("sanitizer fuzz (rc $?): $(grep -E 'ERROR SUMMARY|^fuzz' \
      "$LOGS/sanitizer_fuzz_$backend.log" | tr '\n' ' ')")
    cp "$LOGS/sanitizer_fuzz_$backend.log" "$RESULTS"/
  done
  if [[ ${FUZZ_SANITIZE:-1} == 1 ]]; then
    python3 benchmarks/micro.py schedule >"$RESULTS/schedule.md" 2>&1
    summary+=("scheduler: $RESULTS/schedule.md")
  fi
fi

if [[ $MODE == robust ]]; then
  # The suite's corrupted-input fuzz batches one process after another under compute-sanitizer
  # (the kernel and address of a bad access, attributed to its batch); ROBUST_K selects them.
  timeout "${ROBUST_SECONDS:-540}" compute-sanitizer --tool memcheck --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider -n 0 -x tests/test_robustness.py \
    -k "${ROBUST_K:-fuzz_random_corruptions and gluon}" >"$LOGS/robust.log" 2>&1
  summary+=("robust (rc $?): $(grep -E 'ERROR SUMMARY|passed|failed' "$LOGS/robust.log" |
    tail -3 | tr '\n' ' ')")
  grep -m3 -B2 -A14 "Invalid __global__" "$LOGS/robust.log" | head -60
  cp "$LOGS/robust.log" "$RESULTS"/
fi

if [[ $MODE == tune || $MODE == all ]]; then
  python3 -m pagedattn tune --preset seed --table "$RESULTS/nvidia_h200.csv" \
    --max-minutes "${TUNE_MINUTES:-3}" >"$RESULTS/tune.log" 2>&1
  summary+=("tune rc $?: $(grep -iE 'geometric|worst|noise' "$RESULTS/tune.log" | tail -3 | tr '\n' ' ')")
fi

if [[ $MODE == bench || $MODE == all ]]; then
  # A table tuned in this run overrides the shipped one for the tuned provider.
  [[ -f $RESULTS/nvidia_h200.csv ]] && export PAGEDATTN_TUNING_TABLE=$RESULTS/nvidia_h200.csv
  python3 -m pagedattn bench --out "$RESULTS" "$@" >"$LOGS/bench.log" 2>&1
  summary+=("bench rc $?")
  tail -40 "$LOGS/bench.log"
fi

if [[ $MODE == append || $MODE == all ]]; then
  # append_kv alone: 64, 256, 4096 tokens x 8 kv heads x 128, FP8 per-token and bf16 caches;
  # APPEND_BASE=DIR: also with the sources in DIR (a checkout's src/), in turns, APPEND_ROUNDS
  # times.
  for round in $(seq 1 "${APPEND_ROUNDS:-1}"); do
    for src in ${APPEND_BASE:-} .; do
      name=append_$round$([[ $src == . ]] || echo _base)
      PYTHONPATH=$PWD/$src/src:${PYTHONPATH#*:} timeout "${APPEND_SECONDS:-180}" \
        python3 benchmarks/micro.py append >"$RESULTS/$name.md" 2>&1
      summary+=("$name rc $?: $(grep -E '^\| [0-9]' "$RESULTS/$name.md" |
        awk -F' \\| ' '{printf "%s %s %s us %s%% (copy_ %s%%) %s; ", $1, $2, $6, $8, $10, $11}' |
        tr -d '|')")
      grep -E "^copy ceiling|^bare launch|^\||WRONG|Error" "$RESULTS/$name.md" | tail -14
    done
  done
fi

if [[ $MODE == fa3 || $MODE == all ]]; then
  # FlashInfer's FA3 backend (JIT-compiled for sm_90a) beside pagedattn and XQA: FP8 KV with an
  # FP8 query (flashinfer-fa3-fp8), bf16 KV (flashinfer-fa3).
  # shellcheck disable=SC2086
  timeout "${FA3_SECONDS:-420}" python3 -m pagedattn bench --out "$RESULTS" --name fa3 --no-plots \
    --providers pagedattn,xqa,flashinfer-fa3,flashinfer-fa3-fp8 \
    ${FA3_BENCH_ARGS:---batch 16,128 --context 8192,32768 --query-len 1,4 --kv-dtype fp8,bf16} \
    >"$LOGS/fa3.log" 2>&1
  summary+=("fa3 bench rc $?: $RESULTS/fa3.md")
  cp "$LOGS/fa3.log" "$RESULTS"/
  tail -30 "$LOGS/fa3.log"
fi

if [[ $MODE == cb || $MODE == all ]]; then
  # transformers' continuous batching: its paged|sdpa and pagedattn on a random ~1.1B Llama.
  # shellcheck disable=SC2086
  timeout "${CB_SECONDS:-600}" python3 benchmarks/transformers_cb.py ${CB_ARGS:---cuda-graph off,on} \
    >"$RESULTS/transformers_cb.md" 2>&1
  summary+=("cb rc $?: $(grep -E '^\| paged|^cb tokens equal|graph captures|failed' \
    "$RESULTS/transformers_cb.md" | tr '\n' ' ')")
  tail -8 "$RESULTS/transformers_cb.md"
fi

if [[ $MODE == steady ]]; then
  # examples/generate.py's steady-state decode (median whole step, tokens/s), both caches.
  graphs=(--cuda-graph)
  [[ ${STEADY_EAGER:-0} == 1 ]] && graphs+=(--no-cuda-graph)
  for kv in bf16 fp8; do
    for graph in "${graphs[@]}"; do
      out="$RESULTS/steady_${kv}$([[ $graph == --cuda-graph ]] || echo _eager).txt"
      timeout "${STEADY_SECONDS:-300}" python3 examples/generate.py --kv-cache $kv "$graph" \
        --new-tokens "${STEADY_TOKENS:-256}" >"$out" 2>&1
      summary+=("steady $kv $graph rc $?: $(grep -E '^decode steady state|^tokens match' "$out" |
        tr '\n' ' ')")
    done
  done
fi

if [[ $MODE == host || $MODE == all || $MODE == profile ]]; then
  # Wall time of each eager call (paged_decode, plan_decode reuse=, append_kv), warm path,
  # beside FlashInfer's and XQA's calls and a bare launch, with each call's launches and the
  # rest timed apart; HOST_BASE=DIR: also with the sources in DIR (a checkout's src/), in the
  # same run, alternating HOST_ROUNDS times (the host's speed drifts between processes).
  for round in $(seq 1 "${HOST_ROUNDS:-1}"); do
    timeout "${HOST_SECONDS:-240}" python3 scripts/host_overhead.py --peers --parts \
      >"$RESULTS/host_$round.txt" 2>&1
    summary+=("host $round: $(grep -E '^[a-z_.0-9()]+: ' "$RESULTS/host_$round.txt" | tr '\n' ' ')")
    if [[ -n ${HOST_BASE:-} ]]; then
      PYTHONPATH=$PWD/$HOST_BASE/src:${PYTHONPATH#*:} timeout "${HOST_SECONDS:-240}" \
        python3 scripts/host_overhead.py --peers >"$RESULTS/host_base_$round.txt" 2>&1
      summary+=("host $round ($HOST_BASE): $(grep -E '^[a-z_.0-9]+: ' \
        "$RESULTS/host_base_$round.txt" | tr '\n' ' ')")
    fi
  done
  if [[ $MODE == profile ]]; then
    timeout "${HOST_SECONDS:-240}" python3 scripts/host_overhead.py --profile \
      >"$RESULTS/host_profile.txt" 2>&1
  fi
fi

if [[ $MODE == repro ]]; then
  # The suite's fuzz batches REPRO_BATCHES replayed case by case, the Hopper family preferred,
  # under compute-sanitizer: the case, call, kernel and address of a bad access.
  for batch in ${REPRO_BATCHES:-13 21}; do
    timeout "${REPRO_SECONDS:-240}" compute-sanitizer --tool memcheck --print-limit 10 \
      python3 scripts/fuzz.py --backend "${REPRO_BACKEND:-gluon}" --suite-batch "$batch" \
      >"$LOGS/repro_$batch.log" 2>&1
    summary+=("repro batch $batch (rc $?): $(grep -E 'ERROR SUMMARY' "$LOGS/repro_$batch.log")")
    grep -B3 -A20 -m1 "Invalid\|Error" "$LOGS/repro_$batch.log" | head -50
    cp "$LOGS/repro_$batch.log" "$RESULTS"/
  done
fi

if [[ $MODE == quick ]]; then
  # A few test files (QUICK_TESTS), e.g. the launch path's, before the whole suite.
  # shellcheck disable=SC2086
  timeout "${QUICK_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider -n 6 -x \
    ${QUICK_TESTS:-tests/test_host_path.py tests/test_gluon.py} >"$LOGS/quick.log" 2>&1
  summary+=("quick: $(tail -1 "$LOGS/quick.log")")
  grep -E "^(FAILED|ERROR)|Error" "$LOGS/quick.log" | head -20
  cp "$LOGS/quick.log" "$RESULTS"/
fi

if [[ $MODE == profile ]]; then
  python3 scripts/trace_decode.py "$@" >"$RESULTS/trace.txt" 2>&1
  summary+=("trace: $(grep -E 'programs,' "$RESULTS/trace.txt" | tr '\n' ' ')")
fi

if [[ $MODE == budget ]]; then
  # Each seed step taken apart (plan, decode, reducer; benchmarks/micro.py parts) beside the
  # read ceiling of this run, the programs' trace at the larger shapes, and Nsight Compute's
  # view of the reducer at 128 x 1024 (query_len 4 and 1).
  python3 -c "from pagedattn.bench.ceiling import measure_read_gbps as m; print('read ceiling GB/s', round(m()[0]))" \
    >"$RESULTS/budget_ceiling.txt" 2>&1
  summary+=("$(cat "$RESULTS/budget_ceiling.txt")")
  seed=$(for q in 1 4; do for b in 1 16 64 128 256; do for c in 1024 8192 32768; do
    printf '%sx%sx%s,' $b $c $q; done; done; done)
  large=16x32768x1,64x8192x1,128x8192x1,64x32768x1,256x8192x1,128x32768x1,256x32768x1
  large=$large,$(sed "s/x1\(,\|$\)/x4\1/g" <<<"$large")
  timeout "${BUDGET_SECONDS:-300}" python3 benchmarks/micro.py parts --shapes "${seed%,}" \
    --scales per_tensor >"$RESULTS/budget_parts.txt" 2>&1
  timeout "${BUDGET_SECONDS:-300}" python3 benchmarks/micro.py parts --shapes "$large" \
    --scales per_token >>"$RESULTS/budget_parts.txt" 2>&1
  summary+=("parts: $(grep -c '^| [0-9]' "$RESULTS/budget_parts.txt") shapes")
  timeout "${BUDGET_SECONDS:-300}" python3 scripts/trace_decode.py "$large" \
    >"$RESULTS/budget_trace.txt" 2>&1
  summary+=("trace rc $?: $(grep -c 'programs,' "$RESULTS/budget_trace.txt") shapes")
  for q in 4 1; do
    ncu --clock-control none -k regex:_reduce_kernel --launch-count 1 --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 scripts/profile_decode.py $q 128x1024 \
      >"$RESULTS/budget_reducer_q$q.txt" 2>&1
    summary+=("ncu reducer q$q rc $?")
  done
fi

if [[ $MODE == ab ]]; then
  VAR=$1
  AB=/tmp/ab
  mkdir -p $AB
  for set in "seed --preset seed" \
    "bf16 --batch 16,128 --context 8192,32768 --query-len 1,4 --kv-dtype bf16 --no-plots" \
    "page16 --batch 16,128 --context 8192 --query-len 1,4 --kv-scale per_tensor,per_token --page-size 16,1024 --no-plots"; do
    read -r name args <<<"$set"
    for v in 0 1; do
      # shellcheck disable=SC2086
      env "$VAR=$v" python3 -m pagedattn bench --out "$AB/${VAR}_$v" --name "$name" $args \
        >"$LOGS/bench_${name}_$v.log" 2>&1
      summary+=("$name $VAR=$v rc $?")
    done
    python3 scripts/ab_env.py "$AB/${VAR}_0/$name.csv" "$AB/${VAR}_1/$name.csv" | grep geomean
  done
  tar -C $AB -czf "$RESULTS/ab.tar.gz" .
fi

if [[ $MODE == ab_src || $MODE == ab_multi ]]; then
  # Rounds in one order, then the reverse (A B, B A, ...: drift cancels); the comparison is
  # rewritten after each. ab_src DIR is ab_multi base=DIR,new=.
  if [[ $MODE == ab_src ]]; then builds=("base=$1" "new=."); else IFS=, read -r -a builds <<<"$1"; fi
  shift
  cases=("$@")
  ((${#cases[@]})) || cases=(--preset seed)
  AB=/tmp/$MODE
  mkdir -p "$AB"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    order=("${builds[@]}")
    ((round % 2 == 0)) && mapfile -t order < <(printf '%s\n' "${builds[@]}" | tac)
    for build in "${order[@]}"; do
      name=${build%%=*}
      PYTHONPATH=$PWD/${build#*=}/src:${PYTHONPATH#*:} python3 -m pagedattn bench "${cases[@]}" \
        --name seed --providers pagedattn --no-plots --out "$AB/${name}_$round" \
        >"$LOGS/ab_${name}_$round.log" 2>&1
      summary+=("$MODE $name round $round rc $? at $(date +%T)")
    done
    specs=()
    for build in "${builds[@]}"; do
      name=${build%%=*}
      specs+=("$name=$(seq 1 "$round" | sed "s|.*|$AB/${name}_&/seed.csv|" | paste -sd,)")
    done
    python3 scripts/ab_env.py "${specs[@]}" >"$RESULTS/$MODE.md"
    tar -C "$AB" -czf "$RESULTS/$MODE.tar.gz" .
  done
  tail -45 "$RESULTS/$MODE.md"
fi

echo "================ summary"
printf '%s\n' "${summary[@]}"
