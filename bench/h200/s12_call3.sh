#!/usr/bin/env bash
# H200 session 12, call 3 (stage part 3 of 3: SmolLM2 GGUF, Ray bundle, gguf wheel, py-spy): the draft side of a
# speculative round (bench.draft_round), an in-process TTFT probe, then Serve overhead with replica pacing while
# py-spy samples the proxy, ingress, replica and engine core.
set -u
source bench/h200/s12_staged_env.sh
timeout -s ABRT 150 python3 -m bench.draft_round --modes dominotree,chain --rounds 20 --out $OUT/draft_round.json > $OUT/draft_round.txt 2>&1
echo "draft_round rc=$?"; tail -40 $OUT/draft_round.txt
timeout 60 python3 bench/h200/ttft_probe.py > $OUT/ttft_probe.txt 2>&1
echo "ttft probe rc=$?"; head -60 $OUT/ttft_probe.txt
bash bench/h200/pyspy_serve.sh $OUT &
timeout 240 python3 -m bench.serve_overhead --device cuda --num-prompts 256 --max-tokens 128 \
    --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"; tail -9 $OUT/serve_overhead.txt
wait
tar -C /tmp -czf $OUT/pyspy.tgz pyspy
for f in /tmp/pyspy/*.txt; do echo "== $f"; python3 bench/h200/top_frames.py $f | head -25; done
