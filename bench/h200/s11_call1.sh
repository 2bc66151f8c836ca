#!/usr/bin/env bash
# H200 session 11, call 1 (nvidia-h200): the whole bench.elastic in one run (sizing, vmm incl. the card's 16 GiB in
# ranges and the kept-handle remap probe, cycles, static, negative), then the speculative CUDA-graph GPU tests
# (tiny random model). Carries .stage/smollm2-1, kept on the machine for call 2.
set -u
bash .stage/smollm2-1/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi -L
timeout 420 python3 -m bench.elastic --out $OUT/elastic.json > $OUT/elastic.txt 2>&1
echo "elastic rc=$?"; tail -25 $OUT/elastic.txt
python3 - <<PY
import json; d = json.load(open("$OUT/elastic.json"))
for r in d["vmm"]: print(r["layers"], r["layers_per_range"], r["reserve_bytes"], r["release_after_map"], "commit", r["commit_ms"]["median"], "decommit", r["decommit_ms"]["median"], r["decommit_ms"]["p99"], r["phases_median_ms"])
for k in ("vmm_card_one_range", "vmm_card_remap_kept_handle", "vmm_one_range"): print(k, d.get(k))
for k in ("decommit_ms", "recommit_ms", "prefill_stall_p99_steps", "cycles", "errors", "ooms", "static_commit_oom", "reserve_fraction_tp1", "kv_blocks_gained_when_lent", "section_seconds"): print(k, d.get(k))
PY
timeout 120 python3 -m pytest -m gpu tests/gpu/test_spec_graphs_gpu.py -x -q -p no:cacheprovider --durations=5 > $OUT/spec_graph_tests.txt 2>&1
echo "spec graph tests rc=$?"; tail -30 $OUT/spec_graph_tests.txt
