# `make run` and `make test` each do all the set-up they need on a fresh machine.
SHELL := /bin/bash
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test test-loaded lint typecheck pytest bench clean images up down

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/omniloop run examples/calculator/train.yaml

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck: setup
	.venv/bin/mypy

pytest: setup
	bash scripts/with-services.sh .venv/bin/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# The whole `make test` beside two busy loops: timing assertions must hold on a loaded machine.
test-loaded: setup
	bash scripts/busy-loops.sh $(MAKE) --no-print-directory test

# The dev stack (compose.yaml): build its images, start it (and wait until it is ready), stop it.
images: setup
	bash scripts/stack.sh images

up: setup
	bash scripts/stack.sh up

down:
	bash scripts/stack.sh down

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b; done

clean:
	rm -rf .venv .cache .pytest_cache .mypy_cache .ruff_cache
