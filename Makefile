# Two commands on a fresh machine with python3 and make: `make run`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv system-packages run test bench lock clean

# Debian packages the build and WeasyPrint need, installed only when missing.
system-packages:
	@command -v cmake >/dev/null && command -v ninja >/dev/null && command -v g++ >/dev/null \
		&& ldconfig -p | grep -q libpangoft2-1.0 && ldconfig -p | grep -q libharfbuzz-subset || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q cmake ninja-build build-essential \
			libpango-1.0-0 libpangoft2-1.0-0 libharfbuzz-subset0)

venv: $(STAMP) node_modules/.installed

# The EVM node (anvil) the chain tests run, and the Solidity compiler, from npm.
node_modules/.installed: package.json package-lock.json
	npm ci --silent --no-audit --no-fund
	touch node_modules/.installed

# llama.cpp (for the real-engine test) is compiled from source: portable, no
# tools or servers of its own; pip keeps the built wheel for the next venv.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CCACHE=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml requirements.lock
	$(MAKE) system-packages
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "installing dependencies (the first time compiles llama.cpp: about 4 minutes on 2 cores)"
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

run: venv
	$(BIN)/paralon up

test: venv
	$(BIN)/pytest -q

bench: venv
	$(BIN)/python benchmarks/ledger_throughput.py --json
	$(BIN)/python benchmarks/proxy_overhead.py --json
	$(BIN)/python benchmarks/invoices.py --json

# Re-pin every dependency after editing pyproject.toml.
lock: venv
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) var test-output node_modules
