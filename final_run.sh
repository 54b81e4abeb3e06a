set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=12 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py --tb=line > $OUT/pytest_decode.txt 2>&1; tail -2 $OUT/pytest_decode.txt
python3 -m pagedattn bench --preset seed --out $OUT > /tmp/seed.log 2>&1; echo "seed rc $?"; tail -4 /tmp/seed.log
python3 -m pagedattn bench --out $OUT --name page16 --batch 16,128 --context 8192 --query-len 1,4 --kv-scale per_tensor,per_token --page-size 16,1024 --no-plots > /tmp/p16.log 2>&1; echo "page16 rc $?"
timeout 120 python3 scripts/trace_decode.py 1x1024x1,16x8192x1,64x8192x1,16x32768x1,128x32768x1,64x8192x4,128x32768x4 > $OUT/trace.txt 2>&1; echo "trace rc $?"
grep -E "programs," $OUT/trace.txt
