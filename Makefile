# The README's two commands: `make demo` and `make test`. Both create .venv/ on first use.
# [Note: torch install] A machine that already has torch (e.g. a CUDA build on a GPU box) keeps it:
# the venv then sees the system site-packages. Otherwise torch is pinned to 2.13.0, the CPU build
# served locally on the CI/dev machines, so setup never pulls a multi-GB CUDA wheel there.
# The `hf` extra (transformers) lets the tests train an unmodified Hugging Face GPT-2; the
# `peers` extra (DeepSpeed) is left to users who want its rows in bench.train.
# [Note: gpu-check python] `make gpu-check` needs no venv and installs nothing: GPU machines
# have no package registry, so it runs the checkout (PYTHONPATH) with the interpreter that
# holds the machine's CUDA torch and cupy, python3 unless GPU_PYTHON names another. It exits
# 2 at once on a machine without a GPU; see bench/gpu_check/__init__.py.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zcomm-installed
PYTEST_ARGS ?=
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=

.PHONY: demo test install clean-venv nvcc-check gpu-check

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if python3 -c 'import torch' >/dev/null 2>&1; then python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c 'import torch' >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m bench.demo

nvcc-check: $(STAMP)
	$(PY) -m pytest tests/quant/test_cuda_compile.py -q

gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
