# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both run scripts/setup.sh first, which is idempotent and installs everything they need.

.PHONY: setup demo test

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/zdsl demo

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile
