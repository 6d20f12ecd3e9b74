# behemoth: `make train` runs the CPU demo (NPROC=4 processes, RESTARTS=0 group restarts after a
# failure), `make test` the test suite.
# Both build .venv once (only the system's python3 is reused), then reuse it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.behemoth-installed
TORCH  := torch==2.13.0
NPROC  ?= 4
RESTARTS ?= 0
CONFIG ?= src/behemoth/configs/demo.toml

.PHONY: venv train test config clean-runs

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e '.[all]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/behemoth run --nproc $(NPROC) --max-restarts $(RESTARTS) train $(CONFIG)

config: $(STAMP)
	$(VENV)/bin/behemoth config $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

clean-runs:
	rm -rf runs
