#!/usr/bin/env bash
# H200 session 13, call 5: the kernel GPU tests as parallel pytest processes (Triton compiles on the CPU: 16 cores).
set -u
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
run() { name=$1; shift; timeout -s ABRT 200 python3 -m pytest -q -m gpu "$@" > $OUT/t_$name.txt 2>&1; echo "$name rc=$? $(tail -1 $OUT/t_$name.txt)"; }
A=tests/gpu/test_attention_kernels_gpu.py
for k in decode extend store_kv rms_norm rotary silu; do run $k $A -k $k & done
run skinny tests/gpu/test_skinny_gemm_gpu.py & run pdl tests/gpu/test_pdl_gpu.py & run engine tests/gpu/test_engine_gpu.py &
wait
