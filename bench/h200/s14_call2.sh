#!/usr/bin/env bash
# H200 session 14, call 2 (Ray bundle and py-spy carried, drafter moved out of the tree): which process limits each
# Serve path. One bench.serve_overhead run, 2,048-request loaded sets, 2 repeats of front door (HAProxy) and replica
# port; every process's CPU sampled throughout (bench/h200/proc_cpu.py); the second repeat under py-spy (replica,
# engine core, Serve's proxy actor).
set -u
source bench/h200/bundle_env.sh
xz -dc .whl/py-spy.xz > /tmp/site/bin/py-spy && chmod +x /tmp/site/bin/py-spy
python3 bench/h200/proc_cpu.py sample $OUT/proc_cpu.tsv &
SAMPLER=$!
(
  until grep -q "^replica run 1:" $OUT/serve_overhead.txt 2>/dev/null; do sleep 0.5; done
  mkdir -p /tmp/pyspy
  for name in LLMReplica spawn_main ProxyActor; do
    for pid in $(pgrep -f "$name" | head -1); do
      py-spy record -p $pid -d 40 -r 100 -f raw -o /tmp/pyspy/$name.txt --nonblocking > /tmp/pyspy/$name.log 2>&1 &
    done
  done
  wait
) &
PROFILER=$!
timeout -s ABRT 400 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 2048 --idle-prompts 16 --max-tokens 128 --repeats 2 --ingress haproxy \
    --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"
grep -q "^replica run 1:" $OUT/serve_overhead.txt && wait $PROFILER || kill $PROFILER; kill $SAMPLER
tar -C /tmp -czf $OUT/pyspy.tgz pyspy
for f in /tmp/pyspy/*.txt; do [ -f "$f" ] && { echo "== $f"; python3 bench/h200/top_frames.py $f 2>/dev/null | head -14; }; done
cat /tmp/pyspy/*.log | grep -iv "^$" | head -5
python3 bench/h200/proc_cpu.py report $OUT/proc_cpu.tsv $OUT/serve_overhead.json
grep -E "^(direct|front_door|replica) .*:" $OUT/serve_overhead.txt
grep -v "^\s*$" $OUT/serve_overhead.txt | grep -v Warning | tail -5
