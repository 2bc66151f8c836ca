#!/usr/bin/env bash
# H200 session 12, call 1 (stage part 1 of 3): Llama-3-8B decode at B=64/128/256 with attention stages=3 (issue 3),
# then the kernel, engine and graph GPU tests.
set -u
bash .stage/s12-1/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
nvidia-smi -L
timeout 280 python3 -m bench.engine --shapes llama3-8b --no-hf --out $OUT/engine.json > $OUT/engine.txt 2>&1
echo "engine rc=$?"; grep -E "decode B=|_fraction|output tok/s|^llama" $OUT/engine.txt | head -30
timeout -s ABRT 240 python3 -m pytest -m gpu tests/gpu/test_attention_kernels_gpu.py tests/gpu/test_skinny_gemm_gpu.py \
    tests/gpu/test_spec_graphs_gpu.py tests/gpu/test_engine_gpu.py -q -p no:cacheprovider --tb=short > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|Error|^FAILED|Timeout|File " $OUT/gpu_tests.txt | head -30
