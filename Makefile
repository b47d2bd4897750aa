# Two commands for a fresh machine: `make run` (set up, then serve the demo pair) and `make test`.
# Setup is idempotent: it rebuilds .venv only when pyproject.toml changed since the last setup.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# The CPU build of torch 2.13.0; on machines without a local copy, point PIP_INDEX_URL (or
# PIP_EXTRA_INDEX_URL) at a CPU wheel index so pip does not pull a CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: setup run test lint proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
		|| $(PIP) install "$(TORCH_PIN)" "numpy>=1.26"  # numpy with torch: its import warns without it
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(PIP) install -e ".[dev]"
	$(BIN)/python -c "import kernels, kvpool_service, drafter_service, target_service, ray, grpc, pydantic"
	touch $(STAMP)

run: setup  # the pool plan of a real geometry, then the server with the demo pair (Ctrl-C stops it)
	$(BIN)/dflash plan --target examples/qwen3-8b --drafter examples/qwen3-8b-dflash-b16 \
		--memory 40GiB --max-model-len 32768 --max-num-seqs 64 --avg-seq-len 4096
	$(BIN)/dflash serve

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations 40 tests

lint: setup
	$(BIN)/ruff check .

proto: setup  # regenerate kvpool_service/proto from protos/ (tests fail when it is stale)
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV)
