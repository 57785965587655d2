# The two commands (README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv on first use.
SHELL := /bin/bash
VENV := .venv/bin
export TRITON_INTERPRET ?= 1

.PHONY: setup test demo

setup:
	@bash scripts/setup.sh

test: setup
	$(VENV)/python -m pytest tests

demo: setup
	$(VENV)/quantmla demo
