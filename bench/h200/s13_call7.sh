#!/usr/bin/env bash
# H200 session 13, call 7 (Ray bundle carried, the drafter left out of the tree): the fused tree builder's
# 1,200-case identity test on a cold Triton cache (4 chunks as parallel processes), then Serve overhead on a
# loaded set 4x longer (1,024 requests: 16 waves of 64 streams, ~6 s per path instead of 1.5 s).
set -u
source bench/h200/bundle_env.sh
start=$(date +%s)
T=tests/gpu/test_spec_trees_gpu.py
for c in 0 1 2 3 rest; do
  sel="$T::test_fused_frontier_is_bit_identical_to_reference_on_cuda[$c]"
  [ $c = rest ] && sel="$T --deselect $T::test_fused_frontier_is_bit_identical_to_reference_on_cuda"
  (timeout -s ABRT 150 python3 -m pytest -q -m gpu $sel > $OUT/trees_$c.txt 2>&1
   echo "trees $c rc=$? $(tail -1 $OUT/trees_$c.txt)") &
done
wait; echo "tree tests took $(( $(date +%s) - start )) s"
timeout -s ABRT 300 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 1024 --max-tokens 128 --repeats 3 --out $OUT/serve_overhead_1024.json > $OUT/serve_overhead_1024.txt 2>&1
echo "overhead rc=$?"; tail -11 $OUT/serve_overhead_1024.txt
