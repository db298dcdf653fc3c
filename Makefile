# Two entry points (see README): `make run` runs the main job, `make test` runs the tests.
# Both run scripts/setup.sh first, which is idempotent and installs everything they need.

.PHONY: setup run test test-quick test-thorough

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/zdsl run

# worksteal, not loadfile: a file's tests may run on both workers, so the last big file (the
# prefill or decode models) no longer leaves one core idle. Nothing needs a file's tests in one
# process: fixtures are per test, module or session, and the cache directory is shared (conftest).
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal

# While working: the checks that need no Vulkan device and take seconds each (no model on
# lavapipe, no long check); `make test` before a commit.
test-quick: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal -m "not slow and not device and not llamacpp"

# Ten times the hypothesis examples, and every kernel variant a test draws (tests/budget.py).
test-thorough: setup
	ZDSL_TEST_PROFILE=thorough .venv/bin/python -m pytest -q -n 2 --dist worksteal
