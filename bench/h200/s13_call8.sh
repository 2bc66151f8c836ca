#!/usr/bin/env bash
# Next H200 call (session 13 had no device time left to run it; Ray bundle carried, drafter out of the tree):
# Serve overhead with the engine core merging each stream's outputs, one repeat, short idle set.
set -u
mkdir -p /tmp/site && tar -C /tmp/site -xJf .bundle/ray-serve-cp312.tar.xz
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
timeout -s ABRT 110 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --idle-prompts 8 --num-prompts 512 --max-tokens 128 --out $OUT/serve_overhead_coalesced.json 2>&1 | grep -v "^\s*$" | tail -14
