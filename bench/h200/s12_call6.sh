#!/usr/bin/env bash
# H200 session 12, call 6 (stage part 3 of 3): Serve overhead with one deployment and Ray Serve's throughput
# preset (py-spy on the Serve processes), the draft side with drafter graphs, the TTFT probe under cProfile.
set -u
source bench/h200/s12_staged_env.sh
bash bench/h200/pyspy_serve.sh $OUT &
timeout 200 python3 -m bench.serve_overhead --device cuda --num-prompts 256 --max-tokens 128 \
    --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"; tail -8 $OUT/serve_overhead.txt
timeout -s ABRT 70 python3 -m bench.draft_round --modes dominotree,chain --rounds 20 --out $OUT/draft_round.json > $OUT/draft_round.txt 2>&1
echo "draft_round rc=$?"; grep -A4 "^mode" $OUT/draft_round.txt
timeout 40 python3 bench/h200/ttft_probe.py > $OUT/ttft_probe.txt 2>&1
echo "ttft probe rc=$?"; grep "step ms" $OUT/ttft_probe.txt | head -3; grep -A32 "cumulative" $OUT/ttft_probe.txt | head -45
wait
tar -C /tmp -czf $OUT/pyspy.tgz pyspy; ls /tmp/pyspy; head -3 /tmp/pyspy/*.log
for f in /tmp/pyspy/*.txt; do [ -f "$f" ] && { echo "== $f"; python3 bench/h200/top_frames.py $f | head -22; }; done
