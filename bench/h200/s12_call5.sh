#!/usr/bin/env bash
# H200 session 12, call 5 (stage part 2 of 3): the drafter graphs' GPU tests (speculative/drafter_graphs.py).
set -u
bash .stage/s12-2/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
timeout -s ABRT 80 python3 -m pytest -m gpu tests/gpu/test_drafter_graphs_gpu.py -q -p no:cacheprovider --tb=short > $OUT/drafter_graphs_tests.txt 2>&1
echo "drafter graphs tests rc=$?"; grep -E "passed|failed|^E |^FAILED" $OUT/drafter_graphs_tests.txt | head -20
