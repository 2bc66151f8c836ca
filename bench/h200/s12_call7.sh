#!/usr/bin/env bash
# H200 session 12, call 7 (no staging: Ray bundle carried, the drafter left out of the tree): Serve overhead on the
# SmolLM2-135M shape with random weights, through the front door (proxy) and a replica's direct-ingress port.
set -u
source bench/h200/bundle_env.sh
timeout 210 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 256 --max-tokens 128 --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"; tail -12 $OUT/serve_overhead.txt
