#!/usr/bin/env bash
# H200 session 14, call 3 (Ray bundle carried, drafter moved out of the tree): Serve overhead with the direct engine
# kept up beside the server, every repeat running direct, front door (HAProxy) and replica port in a rotating order
# (3 repeats, 1,024-request loaded sets), each Serve run against its own repeat's direct run; per-process CPU
# sampled throughout.
set -u
source bench/h200/bundle_env.sh
python3 bench/h200/proc_cpu.py sample $OUT/proc_cpu.tsv &
SAMPLER=$!
timeout -s ABRT 480 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 1024 --max-tokens 128 --repeats 3 --ingress haproxy --out $OUT/serve_overhead.json \
    > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"
kill $SAMPLER
python3 bench/h200/proc_cpu.py report $OUT/proc_cpu.tsv $OUT/serve_overhead.json
grep -E "^(direct|front_door|replica) run" $OUT/serve_overhead.txt | sed 's/idle TTFT median/idle/; s/TTFT median/TTFT/'
grep -v "^\s*$" $OUT/serve_overhead.txt | grep -v Warning | tail -4
