#!/usr/bin/env bash
# H200 session 15, call 1 (no bundle): mixed CUDA graphs (steps with prefill chunks replay a graph of their token
# bucket; the extend kernel's packed tile grid). GPU tests of the kernels, graphs and engine, then
# bench.mixed_graphs (graph vs eager per step, interleaved) on the SmolLM2 shape.
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
nvidia-smi -L
timeout -s ABRT 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rA -x tests/gpu/test_mixed_graphs_gpu.py \
    tests/gpu/test_attention_kernels_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_spec_graphs_gpu.py \
    tests/gpu/test_elastic_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $OUT/gpu_tests.txt | tail -40
timeout -s ABRT 200 python3 -m bench.mixed_graphs --out $OUT/mixed_graphs.json > $OUT/mixed_graphs.txt 2>&1
echo "bench rc=$?"; grep -v Warning $OUT/mixed_graphs.txt | tail -10
