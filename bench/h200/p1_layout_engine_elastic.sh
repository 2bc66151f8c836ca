#!/usr/bin/env bash
# H200 session, call 1 of 3 (nvidia-h200-x2): the KV range layout on the GPU (VMM decommit/recommit per layers
# per range, decode roofline and attention, elastic + engine GPU tests). Carries .stage/smollm2-1, kept on the
# machine for the next calls.
set -u
bash .stage/smollm2-1/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi -L
cp bench/results/elastic.json $OUT/elastic.json
timeout 70 python3 -m bench.elastic --sections sizing,vmm --out $OUT/elastic.json > $OUT/elastic.txt 2>&1
echo "elastic rc=$?"; tail -3 $OUT/elastic.txt
python3 -c "
import json; d = json.load(open('$OUT/elastic.json'))
for r in d['vmm']: print(r['layers'], r.get('layers_per_range'), r['reserve_bytes'], 'commit', r['commit_ms']['median'], 'decommit', r['decommit_ms']['median'], r['decommit_ms']['p99'])
print('decommit_ms', d['decommit_ms'], 'recommit_ms', d['recommit_ms'])"
timeout 170 python3 -m bench.engine --shapes llama3-8b --no-hf --attention --out $OUT/engine.json > $OUT/engine.txt 2>&1
echo "engine rc=$?"; grep -E "decode B=|_fraction|overhead|output tok/s|^llama" $OUT/engine.txt
timeout 170 python3 -m pytest -m gpu tests/gpu/test_elastic_gpu.py tests/gpu/test_engine_gpu.py -x -q -p no:cacheprovider \
    --durations=6 > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; tail -12 $OUT/gpu_tests.txt
