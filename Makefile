# kvbench: two commands on a fresh machine.
#   make demo   set up, run the default sweep on the embedded default model, write the report
#   make test   set up, run the test suite
#
# Set-up installs torch first: the CPU build (torch==2.13.0) where there is no NVIDIA GPU, the regular
# CUDA build where there is; then the package with its test and eval extras, editable.
# On a machine whose pip would fetch a CUDA torch for the CPU pin, set TORCH_INDEX, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch
TORCH_INDEX ?=
RUN ?= runs/demo
DATA_DIR ?= ../shared/data
PYTEST_ARGS ?=
TEST_JOBS ?= 2

HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),$(TORCH_GPU),$(TORCH_CPU))
INDEX_FLAG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

.PHONY: setup demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet $(INDEX_FLAG) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,eval]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/kvbench sweep configs/default.yaml --out $(RUN) --resume $(if $(wildcard $(DATA_DIR)),--data-dir $(DATA_DIR))
	$(BIN)/kvbench report $(RUN) --out $(RUN)/report

# The suite in two runs: everything but the `serial` tests on TEST_JOBS workers (pytest-xdist), then the serial
# ones alone (tests/conftest.py says which and why).  Exit status 5 (nothing selected) is not a failure, so
# `make test PYTEST_ARGS=tests/test_x.py` works for any file.
test: setup
	$(BIN)/python -m pytest -q --timeout 900 -n $(TEST_JOBS) -m "not serial" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc
	$(BIN)/python -m pytest -q --timeout 900 -m serial $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc

clean:
	rm -rf $(VENV) runs build *.egg-info
