#!/usr/bin/env bash
# H200 session 15, call 5 (no bundle): elastic KV on CUDA with the mixed graphs (the graphs are released and
# recaptured around the VMM rebuild, and their pool comes out of the slack the burst test leaves), 2,000
# lend/reclaim cycles instead of 10,000 for time; then the graph pool each shape's capture logs.
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
TIDAL_ELASTIC_CYCLES=2000 timeout -s ABRT 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
    tests/gpu/test_elastic_gpu.py > $OUT/elastic_tests.txt 2>&1
echo "elastic tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/elastic_tests.txt | tail -4
for shape in smollm2-135m qwen3-0.6b; do
  timeout 40 python3 -c "
import logging; logging.basicConfig(level=logging.INFO)
from bench.engine import make_llm
llm = make_llm('$shape', device='cuda', gpu_memory_utilization=0.3); llm.shutdown()" 2>&1 | grep "CUDA graphs:" | sed "s/^/$shape: /"
done
