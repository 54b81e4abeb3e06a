set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
OURS=$PWD/src:$PWD:/tmp/site
BASE=$PWD/.ab_base/src:$PWD:/tmp/site
PYTHONPATH=$OURS timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_append.py tests/test_host_path.py > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
run() { name=$1; shift; timeout 120 python3 benchmarks/micro.py append "$@" > $OUT/append_$name.md 2>&1; echo "== $name"; grep -E "^copy|^\| [0-9]|WRONG|rror" $OUT/append_$name.md | cut -c1-160; }
PYTHONPATH=$BASE run base
PYTHONPATH=$OURS run ours
PYTHONPATH=$OURS run t4096w8 --tile 4096 --warps 8
PYTHONPATH=$OURS run t2048 --tile 2048
PYTHONPATH=$OURS run t1024 --tile 1024
PYTHONPATH=$OURS run t8192w8 --tile 8192 --warps 8
PYTHONPATH=$BASE run base2
PYTHONPATH=$OURS run ours2
for i in 1 2; do PYTHONPATH=$OURS python3 scripts/host_overhead.py --peers > $OUT/host_ours_$i.txt 2>&1; PYTHONPATH=$BASE python3 scripts/host_overhead.py --peers > $OUT/host_base_$i.txt 2>&1; done
for f in $OUT/host_*.txt; do echo "== $f"; grep -E "^[a-z_.0-9]+: " $f | tr '\n' ' '; echo; done
