# The README's two commands: `make demo` and `make test`. Both create .venv/ on first use.
# [Note: torch install] A machine that already has torch (e.g. a CUDA build on a GPU box) keeps it:
# the venv then sees the system site-packages. Otherwise torch is pinned to 2.13.0, the CPU build
# served locally on the CI/dev machines, so setup never pulls a multi-GB CUDA wheel there.
# Both install zcomm with the extras they need (see setup.cfg): `mpi` (mpirun, mpi4py) and
# `bench` (tqdm, matplotlib) for the benchmark suites the demo and the tests run, `hf`
# (transformers) so the tests train an unmodified Hugging Face GPT-2, `dev` (pytest, ruff).
# [Note: optional peers] `make peers` (run by `make demo`, not by `make test`) tries the
# `peers` extra, DeepSpeed, for the demo's and bench.train's DeepSpeed rows. It is optional:
# when pip cannot install it (DeepSpeed builds from source and needs torch at build time) it
# says why and exits 0, and those rows then say DeepSpeed is missing. It pins the torch the
# venv already has, so it never swaps in another build (e.g. a multi-GB CUDA wheel).
# [Note: NVRTC on CPU machines] cupy and NVRTC (about 160 MB) are installed even without a GPU:
# NVRTC compiles without a device, so the tests check the PTX of the loader's own compile call
# under hostile flags (tests of zcomm_cuda's flag-proof arithmetic). A machine whose python
# already has cupy (a GPU box) keeps its own.
# [Note: bench from the checkout] `bench` is not installed into the venv: the demo runs it
# with the checkout on PYTHONPATH (so do its child processes), pytest through setup.cfg's
# `pythonpath = .`.
# [Note: gpu-check python] `make gpu-check` needs no venv and installs nothing: GPU machines
# have no package registry, so it runs the checkout (PYTHONPATH) with the interpreter that
# holds the machine's CUDA torch and cupy, python3 unless GPU_PYTHON names another. It exits
# 2 at once on a machine without a GPU; see bench/gpu_check/__init__.py. `make gpu-bench` (the
# speed report, `python -m bench.gpu_check --bench`) runs the same way; without a GPU it runs its CPU part and
# exits 2. `make gpu-lease OUTDIR=...` runs both under hard time limits (about 9.5 minutes in
# all, 12 with the NCCL stage of 2+ GPUs) and packs their results into OUTDIR (bench/gpu_lease.sh); docs/gpu-check.md.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zcomm-installed
PYTEST_ARGS ?=
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
GPU_BENCH_ARGS ?=
OUTDIR ?= gpu-lease-out
CHECKOUT_PYTHONPATH = PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"

PEERS_LOG := $(VENV)/peers-install.log

.PHONY: demo test test-fast install peers clean-venv nvcc-check gpu-check gpu-bench gpu-lease

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if python3 -c 'import torch' >/dev/null 2>&1; then \
	    echo "install: $(VENV)/ sees this python's torch ($$(python3 -c 'import torch; print(torch.__version__)'))"; \
	    python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c 'import torch' >/dev/null 2>&1 || { echo "install: torch 2.13.0, the CPU build"; $(PY) -m pip install -q torch==2.13.0; }
	@echo "install: zcomm from this checkout (editable) with pytest, ruff, transformers, mpich/mpi4py, tqdm, matplotlib"
	@$(PY) -m pip install -q -e '.[dev,hf,mpi,bench]'
	@$(PY) -c 'import cupy' >/dev/null 2>&1 || { \
	  echo "install: cupy + NVRTC (about 160 MB), even without a GPU: NVRTC compiles the CUDA kernels on the CPU so the tests can check what they compile to"; \
	  $(PY) -m pip install -q 'cupy-cuda13x>=14' 'nvidia-cuda-nvrtc==13.0.*'; }
	@touch $@
	@echo "install: done ($(VENV)/)"

# ruff first: it checks the whole tree in well under a second, before minutes of pytest.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast core: every test but the nvcc, host-check, multi-rank and slow groups ([Note: test
# groups] in tests/conftest.py); `make test` runs them all.
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not nvcc and not multirank and not slow" $(PYTEST_ARGS)

peers: $(STAMP)
	@if $(PY) -c 'import deepspeed' >/dev/null 2>&1; then \
	  echo "peers: deepspeed $$($(PY) -c 'import importlib.metadata as m; print(m.version("deepspeed"))') is installed"; \
	else \
	  echo "peers: trying to install the optional peers extra (DeepSpeed); output in $(PEERS_LOG)"; \
	  if DS_BUILD_OPS=0 $(PY) -m pip install -e '.[peers]' "torch==$$($(PY) -c 'import torch; print(torch.__version__)')" \
	      >$(PEERS_LOG) 2>&1 && $(PY) -c 'import deepspeed' >>$(PEERS_LOG) 2>&1; then \
	    echo "peers: installed deepspeed $$($(PY) -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"; \
	  else \
	    echo "peers: DeepSpeed could not be installed; its rows will say so. Last lines of $(PEERS_LOG):"; \
	    tail -n 5 $(PEERS_LOG); \
	  fi; \
	fi

demo: $(STAMP) peers
	$(CHECKOUT_PYTHONPATH) $(PY) -m bench.demo

# The nvcc group alone (nvcc and NVRTC compiles, the host check): [Note: test groups].
nvcc-check: $(STAMP)
	$(PY) -m pytest -q -m nvcc $(PYTEST_ARGS)

gpu-check:
	$(CHECKOUT_PYTHONPATH) $(GPU_PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

gpu-bench:
	$(CHECKOUT_PYTHONPATH) $(GPU_PYTHON) -m bench.gpu_check --bench $(GPU_BENCH_ARGS)

gpu-lease:
	GPU_PYTHON=$(GPU_PYTHON) bench/gpu_lease.sh $(OUTDIR)

clean-venv:
	rm -rf $(VENV)
