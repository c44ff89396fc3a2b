# lightscale: `make demo` and `make test` work on a fresh machine (they create .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# The [litdata] extra of pyproject.toml, installed in two steps (see $(STAMP)); keep the two in step.
LITDATA := litdata>=0.2.50,<0.3
LITDATA_DEPS := lightning-utilities filelock boto3 requests tifffile obstore

.PHONY: venv demo test compat bench bench-diloco soak lint format clean gpu-wheels gpu-check

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
	$(BIN)/pip install --quiet -e ".[dev,deepspeed,ft,float8,data,hf]"
	@# The packages litdata imports, then litdata itself without its torchvision requirement (which would pull another
	@# torch), last: pip checks the dependencies of installed packages after an install that resolves them (not after
	@# --no-deps), so litdata first printed "ERROR: ... litdata requires torchvision" on every fresh venv.
	$(BIN)/pip install --quiet $(LITDATA_DEPS) && $(BIN)/pip install --quiet --no-deps "$(LITDATA)"
	@# Build DeepSpeed's CPU ops now, where lightscale looks for them (like DS_BUILD_CPU_ADAM=1 at install): a
	@# first ZeRO-offload run would otherwise compile them inside its ranks, for minutes, under its timeouts.
	$(BIN)/python -m lightscale.strategies.deepspeed.ops
	$(BIN)/python -c "import torch, lightning, deepspeed, lightscale; print('torch', torch.__version__, '| lightning', lightning.__version__, '| deepspeed', deepspeed.__version__)"
	touch $(STAMP)

# The main job: the small GPT (~10.8M params) on the embedded corpus, 2 CPU processes, TensorBoard logs in runs/.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/lightscale fit --config gpt/small_ddp.yaml

# Two pytest workers (pytest-xdist): a multi-process test spends much of its time waiting (process start-up,
# collectives, a killed rank's timeout), so two at once fill the 2 cores: 51 -> 35 minutes here (2,109 s, 2,120 passed), every test the same.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal --durations=10 tests

# The oldest and newest supported torch + Lightning (+ DeepSpeed), each in a venv cached under .compat/, through a
# smoke subset (a fit per family, save/resume/load, the private-API pins); table in docs/compat.md. Not in CI:
# ~3 GB of CUDA wheels per venv on first use (~5 min each here), then 2-8 minutes of tests per combination.
compat: $(STAMP)
	$(BIN)/python tests/compat/run.py --report runs/compat.md

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/run_all.py

# About three and a half hours on 2 CPU cores, outside `make bench`: DiLoCo's outer lr x momentum x H (the tiny GPT) against DDP
# and local SGD, then the learning figure of the small GPT at H=30 (docs/benchmarks.md, "DiLoCo").
bench-diloco: $(STAMP)
	mkdir -p runs
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/sweep_diloco.py --out runs/sweep_diloco.json
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/diloco_learning.py --out runs/diloco_learning.json

# Minutes per strategy family, outside `make test`: host RSS and step-time slopes over 2,000 steps (docs/benchmarks.md).
soak: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/soak.py

# Everything a project GPU machine (Python 3.12, CUDA torch, Lightning; no network) lacks, as wheels in one folder
# that travels with the working tree as a `carry` path (git-ignored). docs/gpu.md says how to run the check.
GPU_WHEELS ?= gpu_wheels
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w $(GPU_WHEELS) .
	DS_BUILD_OPS=0 $(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w $(GPU_WHEELS) \
		deepspeed==$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('deepspeed'))")
	$(BIN)/python benchmarks/gpu_wheels.py download $(GPU_WHEELS)
	@ls $(GPU_WHEELS) && du -sh $(GPU_WHEELS)

# On the GPU machine (its own python3, not .venv): install the missing wheels beside the machine's packages, then
# every check within 9 minutes; the report goes to $$OUT/gpu_report.md (or ./gpu_report.md). Exits 0 on failures.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/lightscale_gpu_site
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_wheels.py install $(GPU_WHEELS) $(GPU_SITE)
	PYTHONPATH=$(CURDIR):$(GPU_SITE) TORCH_EXTENSIONS_DIR=$(GPU_SITE)/torch_extensions \
		$(GPU_PYTHON) benchmarks/gpu_check.py --site $(GPU_SITE)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs lightning_logs .compat
