# megatron-vlm: `make demo` runs the end-to-end demo, `make test` runs the test suite.
# Both create the virtual environment (.venv-pyXY) and install the pinned dependencies first.
# PYTHON picks the lane: python3.11 -> megatron-core 0.16, python3.12 -> megatron-core 0.19
# (`make test PYTHON=python3.12`); each lane has its own venv and constraints/pyXY.txt.
PYTHON ?= python3
PYTHON_BIN := $(shell .ci/find-python $(PYTHON))
ifeq ($(PYTHON_BIN),)
$(error no working $(PYTHON): install it, or pass PYTHON=/path/to/python)
endif
PYDOT := $(shell $(PYTHON_BIN) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYVER := $(subst .,,$(PYDOT))
CONSTRAINTS := constraints/py$(PYVER).txt
VENV ?= .venv-py$(PYVER)
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_ARGS ?=
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers, a module per worker at a time (its fixtures are
# built once), longest modules first (tests/conftest.py's measured order: --no-loadscope-reorder keeps xdist from
# reordering modules by their count of tests); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
# Lanes that install Transformer Engine (its torch extension is compiled once per machine and cached outside the
# repository, see tools/install_te.py; the 3.11 lane's CPU torch cannot build it).
TE_LANES := 312

.PHONY: venv test test-fast demo bench gpu-kit clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml $(wildcard $(CONSTRAINTS)) tools/install_te.py
	@test -f $(CONSTRAINTS) || { echo "no $(CONSTRAINTS): Python $(PYDOT) is not a supported lane (3.11, 3.12)" >&2; exit 1; }
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[test,demo]"
	$(if $(filter $(PYVER),$(TE_LANES)),$(PY) tools/install_te.py --constraints $(CONSTRAINTS))
	touch $@

test: venv
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder) $(PYTEST_ARGS)

# The unit-level tests only (no spawned world, no torchrun, no command run as a subprocess, no demo; < 3 min):
# the inner loop while developing. A test that starts a process fails here until it is marked slow.
test-fast: venv
	MVLM_FAST=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: venv
	$(PY) demo/run_demo.py $(DEMO_ARGS)

# The benchmarks behind the README's performance section (each prints ratios measured in one run; ~15 min).
bench: venv
	$(PY) bench/convert.py
	$(PY) bench/data_prep.py
	$(PY) bench/train.py

# The GPU kit (bench/GPU.md): the cp312 wheels the lent GPU machine lacks, the project and bench/gpu_quick.sh in
# .gpu_kit/ (ignored; <= 60 MiB, refused when over). Needs the Python 3.12 lane's venv (its pip and packaging).
# TE=DIR adds the Transformer Engine wheels of DIR (tools/build_te_sm90.py, bench/GPU.md section 4).
gpu-kit:
	@test -x .venv-py312/bin/python || { echo "gpu-kit needs .venv-py312: run make venv PYTHON=python3.12 first" >&2; exit 1; }
	.venv-py312/bin/python tools/gpu_kit.py $(if $(TE),--te $(TE))

clean:
	rm -rf $(VENV) .pytest_cache
