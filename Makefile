# Two entry points (see README): `make run` runs the main job, `make test` runs the tests.
# Both run scripts/setup.sh first, which is idempotent and installs everything they need.

.PHONY: setup run test

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/zdsl run

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile
