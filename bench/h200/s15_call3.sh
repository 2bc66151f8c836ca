#!/usr/bin/env bash
# H200 x2 session 15, call 3 of the 3-part stage (part 3; the s14 stage: SmolLM2 GGUF, Ray bundle, every wheel of
# .whl). After the mixed graphs: `tidal serve` end to end on the GPUs (tests/gpu/test_serve_gpu.py: the default
# model at TP=1 through HAProxy, greedy equal to the offline engine; a TP=2 replica with NCCL ranks on two GPUs
# equal to TP=1) beside, on GPU 1, the 450 random extend-kernel cases (the first run's Triton 3.6 compiler
# failure on case 303 first), then the engine GPU tests with the real SmolLM2 (bf16 vs HF).
set -u
source bench/h200/s14_staged_env.sh
nvidia-smi -L
(CUDA_VISIBLE_DEVICES=1 timeout -s ABRT 400 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
    "tests/gpu/test_attention_kernels_gpu.py::test_extend_random[303]" tests/gpu/test_attention_kernels_gpu.py \
    -k extend > $OUT/extend_tests.txt 2>&1; echo "extend tests rc=$?" >> $OUT/extend_tests.txt) &
timeout -s ABRT 240 python3 -m pytest -m gpu tests/gpu/test_serve_gpu.py -q -p no:cacheprovider -rA \
    > $OUT/serve_tests.txt 2>&1
echo "serve tests rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $OUT/serve_tests.txt | tail -6
CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
    tests/gpu/test_engine_gpu.py tests/gpu/test_mixed_graphs_gpu.py > $OUT/engine_tests.txt 2>&1
echo "engine tests rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $OUT/engine_tests.txt | tail -8
wait
tail -3 $OUT/extend_tests.txt; grep -E "^FAILED" $OUT/extend_tests.txt | head
