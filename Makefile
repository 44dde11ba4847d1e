# Two commands on a fresh machine with python3 and make: `make run`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run test bench lock clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

run: venv
	$(BIN)/paralon migrate
	$(BIN)/paralon demo

test: venv
	$(BIN)/pytest -q

bench: venv
	$(BIN)/python benchmarks/ledger_throughput.py --json

# Re-pin every dependency after editing pyproject.toml.
lock: venv
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) var test-output
