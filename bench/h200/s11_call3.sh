#!/usr/bin/env bash
# H200 session 11, call 3 (stage part 1 of 3): decode at B=64/128/256 with the start-up GEMM selection and the new
# attention split rule (bench.engine, Llama-3-8B shape), the decode tuning sweep, the skinny GEMM GPU tests.
set -u
bash .stage/s11-1/keep.sh || true
# run HEAD (.stage/snap.tgz, git archive without the drafter), not the working tree: helpers are mid-edit
mkdir -p /tmp/snap && tar -C /tmp/snap -xzf .stage/snap.tgz && cd /tmp/snap
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi -L
timeout 230 python3 -m bench.engine --shapes llama3-8b --no-hf --out $OUT/engine.json > $OUT/engine.txt 2>&1
echo "engine rc=$?"; grep -E "decode B=|_fraction|gemm|GEMM|skinny|output tok/s|^llama" $OUT/engine.txt | head -30
timeout 200 python3 -m bench.decode_tune --budget-s 160 --out $OUT/decode_tune.json > $OUT/decode_tune.txt 2>&1
echo "decode_tune rc=$?"; tail -60 $OUT/decode_tune.txt
timeout 100 python3 -m pytest -m gpu tests/gpu/test_skinny_gemm_gpu.py -x -q -p no:cacheprovider > $OUT/skinny_tests.txt 2>&1
echo "skinny tests rc=$?"; tail -8 $OUT/skinny_tests.txt
