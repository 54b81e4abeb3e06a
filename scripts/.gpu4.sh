set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
OURS=$PWD/src:$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$OURS timeout 280 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_host_path.py tests/test_append.py tests/test_decode.py tests/test_ops.py tests/test_schedule.py tests/test_launch.py tests/test_gluon.py > $OUT/tests.log 2>&1; echo "tests: $(tail -1 $OUT/tests.log)"; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
PYTHONPATH=$OURS timeout 120 python3 benchmarks/micro.py append > $OUT/append.md 2>&1; grep -E "^copy|^\| [0-9]|WRONG|rror" $OUT/append.md | cut -c1-160
PYTHONPATH=$OURS python3 scripts/host_overhead.py --peers --profile > $OUT/host1.txt 2>&1
PYTHONPATH=$OURS python3 scripts/host_overhead.py --peers > $OUT/host2.txt 2>&1
for f in $OUT/host*.txt; do echo "== $f"; grep -E "^[a-z_.0-9]+: " $f | tr '\n' ' '; echo; done
