# Two entry points: `make demo` (main job on embedded defaults) and `make test` (whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0

.PHONY: demo test setup setup-test redis-server clean

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels.
	$(PIP) install -q $(TORCH)
	touch $@

$(VENV)/.base: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e '.[test,llama-index,bench,train]'
	touch $@ $(VENV)/.base

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server from Debian's packages"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }

setup: $(VENV)/.base
setup-test: $(VENV)/.test redis-server

demo: setup
	$(VENV)/bin/ragcache demo

test: setup-test
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) .ragcache
