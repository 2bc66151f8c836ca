#!/usr/bin/env bash
# H200 call 1 of a session: GPU tests, engine roofline (Llama-3-8B, Qwen3-0.6B shapes), elastic VMM + sizing.
# Carries .stage/smollm2-1 (part 1 of the SmolLM2 GGUF for the next call). Results land in $OUT.
set -u
bash .stage/smollm2-1/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 230 python3 -m pytest -m gpu tests/gpu tests/test_sampler.py -q -x -p no:cacheprovider --durations=8 \
    > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$?"; tail -14 $OUT/gpu_tests.txt
cp bench/results/elastic.json $OUT/elastic.json
timeout 90 python3 -m bench.elastic --sections sizing,vmm --out $OUT/elastic.json > $OUT/elastic.txt 2>&1
echo "elastic rc=$?"; tail -25 $OUT/elastic.txt
timeout 230 python3 -m bench.engine --shapes llama3-8b,qwen3-0.6b --attention --out $OUT/engine.json \
    > $OUT/engine.txt 2>&1; echo "engine rc=$?"; tail -45 $OUT/engine.txt
