# lightscale: `make demo` and `make test` work on a fresh machine (they create .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: venv demo test bench soak lint format clean

venv: $(STAMP)

# torch is pinned first so nothing pulls a CUDA build on a CPU machine (a GPU machine gets the default CUDA
# build of the same version); DeepSpeed builds from source against it, its CPU ops (CPU Adam, async I/O) built once below.
$(STAMP): pyproject.toml
	@# libaio lets DeepSpeed build its async I/O op (zero_infinity); installed only where we may (root + apt).
	@if [ ! -e /usr/include/libaio.h ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null || echo "libaio-dev not installed: zero_infinity unavailable"; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet ninja py-cpuinfo psutil pydantic hjson msgpack packaging numpy
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation deepspeed
	$(BIN)/pip install --quiet -e ".[dev,deepspeed,ft]"
	@# Build DeepSpeed's CPU ops now, where lightscale looks for them (like DS_BUILD_CPU_ADAM=1 at install): a
	@# first ZeRO-offload run would otherwise compile them inside its ranks, for minutes, under its timeouts.
	$(BIN)/python -m lightscale.strategies.deepspeed_ops
	$(BIN)/python -c "import torch, lightning, deepspeed, lightscale; print('torch', torch.__version__, '| lightning', lightning.__version__, '| deepspeed', deepspeed.__version__)"
	touch $(STAMP)

# The main job: the small GPT (~10.8M params) on the embedded corpus, 2 CPU processes, TensorBoard logs in runs/.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/lightscale fit --config gpt/small_ddp.yaml

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 tests

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/run_all.py

# Minutes per strategy family, outside `make test`: host RSS and step-time slopes over 2,000 steps (docs/benchmarks.md).
soak: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/soak.py

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs lightning_logs
