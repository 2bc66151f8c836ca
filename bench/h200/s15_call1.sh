#!/usr/bin/env bash
# Next H200 call (session 14 had no device time left for it; Ray bundle carried, drafter moved out of the tree):
# Serve overhead with the fair baseline: the direct engine runs the replica's stream-item budget
# (EngineConfig.stream_item_ms), the engine computes its streams' interval itself. Three interleaved repeats of
# direct, front door (HAProxy) and replica port, 1,024-request loaded sets; per-process CPU sampled throughout.
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
