# The two commands of the quick start. Both install what they need the first time (deploy/setup.sh).
CONFIG ?= configs/tiny_cpu.toml
ARGS ?=

.PHONY: setup train test lint
setup:
	@bash deploy/setup.sh

train: setup
	.venv/bin/async-vapo train --config $(CONFIG) $(ARGS)

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q $(ARGS)

lint: setup
	.venv/bin/ruff check .
