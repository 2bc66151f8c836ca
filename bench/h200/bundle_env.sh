# Sourced by the H200 calls that carry the Ray bundle (.bundle/ray-serve-cp312.tar.xz): unpack it and point
# Python at it, the repository and the tests' helpers.
mkdir -p /tmp/site && tar -C /tmp/site -xJf .bundle/ray-serve-cp312.tar.xz
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONFAULTHANDLER=1
