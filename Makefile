# megatron-vlm: `make demo` runs the end-to-end demo, `make test` runs the test suite.
# Both create the virtual environment (.venv) and install the pinned dependencies first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: venv test demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test,demo]"
	touch $@

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: venv
	$(PY) demo/run_demo.py $(DEMO_ARGS)

# The benchmarks behind the README's performance section (each prints ratios measured in one run; ~15 min).
bench: venv
	$(PY) bench/convert.py
	$(PY) bench/data_prep.py
	$(PY) bench/train.py

clean:
	rm -rf $(VENV) .pytest_cache
