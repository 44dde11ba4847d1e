# Two commands on a fresh machine with python3 and make: `make run`, `make test`.
# `make run` installs only what the service needs (requirements.lock); `make test`
# adds the test tools (requirements-dev.lock, llama.cpp included) and the EVM node.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
PIP := $(BIN)/pip install -q --disable-pip-version-check
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := $(SUDO) apt-get install -y -q --no-install-recommends
# Parallel test processes: most tests wait on servers they start, not on the CPU.
TEST_PROCESSES ?= 4

.PHONY: venv dev-venv run-packages dev-packages run test lint bytecode bench lock clean

# WeasyPrint's Pango and HarfBuzz, installed only when missing.
run-packages:
	@ldconfig -p | grep -q libpangoft2-1.0 && ldconfig -p | grep -q libharfbuzz-subset || \
		($(SUDO) apt-get update -q && $(APT) libpango-1.0-0 libpangoft2-1.0-0 libharfbuzz-subset0)

# The compilers llama.cpp (the real-engine test) is built with, and the
# headless Chromium the API-docs test drives through Playwright.
dev-packages:
	@command -v cmake >/dev/null && command -v ninja >/dev/null && command -v g++ >/dev/null \
		&& command -v chromium >/dev/null || \
		($(SUDO) apt-get update -q && $(APT) cmake ninja-build build-essential chromium)

venv: $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml requirements.lock
	$(MAKE) run-packages
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -r requirements.lock
	$(PIP) --no-deps -e .
	touch $(RUN_STAMP)

dev-venv: $(DEV_STAMP) node_modules/.installed

# llama.cpp is compiled from source: portable, no tools or servers of its own;
# pip keeps the built wheel for the next venv.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CCACHE=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

$(DEV_STAMP): $(RUN_STAMP) requirements-dev.lock
	$(MAKE) dev-packages
	@echo "installing test tools (the first time compiles llama.cpp: about 4 minutes on 2 cores)"
	$(PIP) -r requirements-dev.lock
	touch $(DEV_STAMP)

# The EVM node (anvil) the chain tests run, and the Solidity compiler, from npm.
node_modules/.installed: package.json package-lock.json
	npm ci --silent --no-audit --no-fund
	touch node_modules/.installed

run: venv bytecode
	$(BIN)/paralon up

test: dev-venv lint bytecode
	$(BIN)/pytest -q -n $(TEST_PROCESSES) --durations=25

# The project's own bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is
# set, every process (each `serve` and command a test starts) would otherwise
# compile every module from source again, about 0.3 s of CPU each. A module
# edited since is compiled from its source as usual (the bytecode records the
# source's time).
bytecode: venv
	@$(BIN)/python -m compileall -q -j 0 app ledger proxy invoices tests benchmarks migrations >/dev/null

# The layer contracts of the README's map (import-linter).
lint: dev-venv
	$(BIN)/lint-imports --no-cache

bench: dev-venv
	$(BIN)/python benchmarks/ledger_throughput.py --json
	$(BIN)/python benchmarks/ledger_throughput.py --postings-in-event-row --json
	$(BIN)/python benchmarks/ledger_throughput.py --postings-in-event-row --pooled-holds --json
	$(BIN)/python benchmarks/append_statement.py --json
	$(BIN)/python benchmarks/settlement_instructions.py --json
	$(BIN)/python benchmarks/postings_layout.py --json
	$(BIN)/python benchmarks/holds_writes.py --json
	$(BIN)/python benchmarks/batch_overhead.py --json
	$(BIN)/python benchmarks/proxy_overhead.py --json
	$(BIN)/python benchmarks/ttft_path.py --json
	$(BIN)/python benchmarks/invoices.py --json
	$(BIN)/python benchmarks/verify_replay.py --json

# Re-pin every dependency after editing pyproject.toml: the service's own, then
# the test tools constrained to the same versions.
lock: venv
	$(PIP) uv
	$(BIN)/uv pip compile -q pyproject.toml --python-version 3.11 --custom-compile-command "make lock" -o requirements.lock
	$(BIN)/uv pip compile -q pyproject.toml --extra dev -c requirements.lock --python-version 3.11 \
		--custom-compile-command "make lock" -o requirements-dev.lock

clean:
	rm -rf $(VENV) var test-output node_modules
