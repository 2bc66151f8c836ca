#!/usr/bin/env bash
# H200 session 12, call 4 (stage part 1 of 3 again, fresh machine): issue 3's figures in one bench.engine run
# (Qwen3-0.6B and Llama-3-8B shapes, attention kernels, HF baseline), nothing else (the run must finish).
set -u
bash .stage/s12-1/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
nvidia-smi -L
timeout 300 python3 -m bench.engine --shapes qwen3-0.6b,llama3-8b --attention --out $OUT/engine.json > $OUT/engine.txt 2>&1
echo "engine rc=$?"; grep -E "decode B=|_fraction|tree_mask|throughput_vs_hf|output tok/s|HF" $OUT/engine.txt | head -30
