#!/usr/bin/env bash
# H200 session 14, call 1 (Ray bundle carried, drafter moved out of the tree). The engine now coalesces by not
# building held requests' outputs (replicas/stream_coalescer.py decides who reports), instead of building and
# merging them in the core. (1) Serve overhead, 1,024-request loaded set, HAProxy and the replica port alternating
# 3 times, with the engine's tokens per step and ms per step per path. (2) A longer single run under py-spy
# (replica, engine core) to see what limits the loaded Serve path.
set -u
source bench/h200/bundle_env.sh
timeout -s ABRT 300 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 1024 --max-tokens 128 --repeats 3 --ingress haproxy --out $OUT/serve_overhead.json \
    > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"
bash bench/h200/pyspy_serve.sh &
timeout -s ABRT 150 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 2048 --idle-prompts 8 --max-tokens 128 --ingress haproxy --out $OUT/serve_overhead_pyspy.json \
    > $OUT/serve_overhead_pyspy.txt 2>&1
wait
tar -C /tmp -czf $OUT/pyspy.tgz pyspy
for f in /tmp/pyspy/*.txt; do [ -f "$f" ] && { echo "== $f"; python3 bench/h200/top_frames.py $f | head -16; }; done
grep -E "^(direct|front_door|replica) " $OUT/serve_overhead_pyspy.txt
grep -v "^\s*$" $OUT/serve_overhead.txt | grep -v Warning | tail -16
