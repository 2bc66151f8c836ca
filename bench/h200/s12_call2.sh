#!/usr/bin/env bash
# H200 session 12, call 2 (stage part 2 of 3): the fused Triton tree builder, smoke first (faulthandler dumps the
# stack if it hangs), then its GPU identity tests; then the elastic GPU tests.
set -u
bash .stage/s12-2/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
timeout -s ABRT 200 python3 -m bench.tree_builder --cases 20 --rounds 20 --batches 1 8 --out $OUT/tree_smoke.json > $OUT/tree_smoke.txt 2>&1
echo "tree smoke rc=$?"; tail -40 $OUT/tree_smoke.txt
timeout -s ABRT 200 python3 -m pytest -m gpu tests/gpu/test_spec_trees_gpu.py -q -p no:cacheprovider --tb=short > $OUT/tree_tests.txt 2>&1
echo "tree tests rc=$?"; grep -E "passed|failed|^FAILED|File " $OUT/tree_tests.txt | head -20
timeout -s ABRT 150 python3 -m pytest -m gpu tests/gpu/test_elastic_gpu.py -q -p no:cacheprovider --tb=short > $OUT/elastic_tests.txt 2>&1
echo "elastic tests rc=$?"; tail -3 $OUT/elastic_tests.txt
