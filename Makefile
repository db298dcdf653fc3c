# Two entry points (see README): `make run` runs the main job, `make test` runs the tests.
# Both run scripts/setup.sh first, which is idempotent and installs everything they need.

.PHONY: setup run test

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/zdsl run

# worksteal, not loadfile: a file's tests may run on both workers, so the last big file (the
# prefill or decode models) no longer leaves one core idle. Nothing needs a file's tests in one
# process: fixtures are per test, module or session, and the cache directory is shared (conftest).
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal
