#!/usr/bin/env bash
# H200 x2 session 14, call 4 of the 3-part stage (part 3: SmolLM2 GGUF, Ray bundle, openai and gguf wheels; parts
# 1 and 2 only kept): `tidal serve` end to end on the GPUs after this session's engine and front-door changes
# (tests/gpu/test_serve_gpu.py: the default model at TP=1 through HAProxy, greedy equal to the offline engine;
# a TP=2 replica with NCCL ranks on two GPUs equal to TP=1), then two more interleaved Serve-overhead repeats on
# GPU 0 (1,024-request loaded sets). First run (call 4) found no sniffio for the openai SDK; this stage carries every
# wheel of .whl.
set -u
source bench/h200/s14_staged_env.sh
nvidia-smi -L
timeout -s ABRT 260 python3 -m pytest -m gpu tests/gpu/test_serve_gpu.py -q -p no:cacheprovider -rA \
    > $OUT/serve_tests.txt 2>&1
echo "serve tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/serve_tests.txt | tail -6
CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 170 python3 -m bench.serve_overhead --device cuda --model smollm2-135m \
    --load-format dummy --num-prompts 1024 --max-tokens 128 --repeats 2 --ingress haproxy \
    --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"
grep -E "^(direct|front_door|replica) run" $OUT/serve_overhead.txt | sed 's/idle TTFT median/idle/; s/TTFT median/TTFT/'
grep -v "^\s*$" $OUT/serve_overhead.txt | grep -v Warning | tail -4
