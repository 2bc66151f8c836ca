#!/usr/bin/env bash
# H200 session 13, call 4: issue 3 with programmatic dependent launch (PDL) in the decode path's Triton kernels.
# 1) bench.engine on the Llama-3-8B shape, PDL on (the default), alone on the GPU;
# 2) the kernel GPU tests as parallel pytest processes (Triton compiles on the CPU: 16 cores, one shard each);
# 3) bench.engine again with TIDAL_PDL=0, for the same-machine comparison, if time is left.
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
nvidia-smi -L; python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
python3 -c "import torch; from replicas.layers.pdl import pdl_enabled; print('pdl', pdl_enabled(torch.device('cuda')))"
timeout -s ABRT 250 python3 -m bench.engine --shapes llama3-8b --no-hf --out $OUT/engine_pdl.json > $OUT/engine_pdl.txt 2>&1
echo "engine pdl rc=$?"; grep -E "decode B=|_fraction|output tok/s" $OUT/engine_pdl.txt | head -12
run() { timeout -s ABRT 170 python3 -m pytest -q -m gpu "$@" > $OUT/t_$1_$2.txt 2>&1; echo "$1 $2 rc=$? $(tail -1 $OUT/t_$1_$2.txt)"; }
A=tests/gpu/test_attention_kernels_gpu.py
for k in decode extend store_kv rms_norm rotary silu; do run $A -k $k & done
run tests/gpu/test_skinny_gemm_gpu.py -x & run tests/gpu/test_pdl_gpu.py -x & run tests/gpu/test_engine_gpu.py -x &
wait
timeout -s ABRT 140 env TIDAL_PDL=0 python3 -m bench.engine --shapes llama3-8b --no-hf --decode-batches 64,128,256 \
  --out $OUT/engine_nopdl.json > $OUT/engine_nopdl.txt 2>&1
echo "engine no-pdl rc=$?"; grep -E "decode B=|_fraction|output tok/s" $OUT/engine_nopdl.txt | head -12
grep -A40 "GEMM selection" $OUT/engine_pdl.txt | head -45 > $OUT/gemm_choices.txt
