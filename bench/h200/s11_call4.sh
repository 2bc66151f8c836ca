#!/usr/bin/env bash
# H200 session 11, call 4 (stage part 2 of 3): the fused Triton tree builder (GPU identity tests, ms per round and
# kernels per round) and the attention kernels' GPU tests under the new split rule. Runs HEAD from .stage/snap.tgz.
set -u
bash .stage/s11-2/keep.sh || true
mkdir -p /tmp/snap4 && tar -C /tmp/snap4 -xzf .stage/snap.tgz && cd /tmp/snap4
export PYTHONPATH=$PWD:$PWD/tests
timeout 150 python3 -m pytest -m gpu tests/gpu/test_spec_trees_gpu.py -q -p no:cacheprovider > $OUT/tree_tests.txt 2>&1
echo "tree tests rc=$?"; tail -15 $OUT/tree_tests.txt
timeout 150 python3 -m bench.tree_builder --cases 1000 --rounds 200 --out $OUT/tree_builder.json > $OUT/tree_builder.txt 2>&1
echo "tree bench rc=$?"; tail -30 $OUT/tree_builder.txt
timeout 150 python3 -m pytest -m gpu tests/gpu/test_attention_kernels_gpu.py -x -q -p no:cacheprovider > $OUT/attn_tests.txt 2>&1
echo "attention tests rc=$?"; tail -5 $OUT/attn_tests.txt
