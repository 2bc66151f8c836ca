#!/usr/bin/env bash
# H200 session 13, call 1 (stage part 1 of 2: the SmolLM2 GGUF and the gguf wheel): the draft-side GPU tests that
# have not run since their last change (drafter graphs, static-shape context graphs, speculative engine graphs).
set -u
bash .stage/s13-1/keep.sh || true
export PYTHONPATH=$PWD:$PWD/tests PYTHONFAULTHANDLER=1
nvidia-smi -L
for t in test_drafter_graphs_gpu test_context_graphs_gpu test_spec_graphs_gpu; do
  timeout -s ABRT 170 python3 -m pytest -q -m gpu -x tests/gpu/$t.py > $OUT/$t.txt 2>&1
  echo "$t rc=$?"; tail -3 $OUT/$t.txt
done
