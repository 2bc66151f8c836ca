#!/usr/bin/env bash
# H200 session 13, call 6 (Ray bundle carried, the drafter left out of the tree): Serve overhead after the pacing
# fix (front door and replica port, 3 alternating repeats), then issue 3's figures in one bench.engine run
# (Qwen3-0.6B and Llama-3-8B shapes, attention kernels, HF baseline), each alone on the GPU.
set -u
source bench/h200/bundle_env.sh
timeout -s ABRT 220 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 256 --max-tokens 128 --repeats 3 --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"; tail -11 $OUT/serve_overhead.txt
ray stop --force > /dev/null 2>&1
timeout -s ABRT 330 python3 -m bench.engine --shapes qwen3-0.6b,llama3-8b --attention --out $OUT/engine.json \
    > $OUT/engine.txt 2>&1
echo "engine rc=$?"; grep -E "decode B=|_fraction|tree_mask|throughput_vs_hf|output tok/s" $OUT/engine.txt | head -20
