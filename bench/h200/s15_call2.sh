#!/usr/bin/env bash
# H200 session 15, call 2 (Ray bundle carried, drafter moved out of the tree). After the mixed graphs and the
# extend kernel's single early exit: the extend-kernel GPU cases (the first run's compiler failure) and the engine
# GPU tests, then the Serve overhead (4 interleaved repeats, direct engine with the replica's stream-item budget,
# HAProxy front door and replica port, 1,024-request loaded sets) with per-process CPU sampled.
set -u
source bench/h200/bundle_env.sh
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
timeout -s ABRT 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/gpu/test_attention_kernels_gpu.py -k "extend or mixed or engine or triton" \
    tests/gpu/test_mixed_graphs_gpu.py tests/gpu/test_engine_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; grep -E "FAILED|ERROR|SKIPPED|passed|failed" $OUT/gpu_tests.txt | tail -8
python3 bench/h200/proc_cpu.py sample $OUT/proc_cpu.tsv &
SAMPLER=$!
timeout -s ABRT 380 python3 -m bench.serve_overhead --device cuda --model smollm2-135m --load-format dummy \
    --num-prompts 1024 --max-tokens 128 --repeats 4 --ingress haproxy --out $OUT/serve_overhead.json \
    > $OUT/serve_overhead.txt 2>&1
echo "overhead rc=$?"
kill $SAMPLER
python3 bench/h200/proc_cpu.py report $OUT/proc_cpu.tsv $OUT/serve_overhead.json | tail -12
grep -E "^(direct|front_door|replica) run" $OUT/serve_overhead.txt | sed 's/idle TTFT median/idle/; s/TTFT median/TTFT/'
grep -v "^\s*$" $OUT/serve_overhead.txt | grep -v Warning | tail -4
