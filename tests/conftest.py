"""Shared fixtures: one lavapipe device per test session, a private cache directory."""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Tests never touch the user's cache. The directory is made once per session: pytest loads this
# file in the xdist controller too, and the workers inherit its environment, so they share it
# (entries are written atomically; a SPIR-V module compiled by one worker is read by the other).
os.environ.setdefault("ZDSL_CACHE_DIR", tempfile.mkdtemp(prefix="zdsl-test-cache-"))

# Two hypothesis profiles: the default keeps `make test` within minutes on 2 cores; `thorough`
# (ZDSL_TEST_PROFILE=thorough, `make test-thorough`) draws ten times the examples and, on a
# device, every variant a test draws rather than one per case (kernel_testing.pick).
_CHECKS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("zdsl", deadline=None, max_examples=10, derandomize=True, suppress_health_check=_CHECKS)
settings.register_profile("thorough", deadline=None, max_examples=100, derandomize=True, suppress_health_check=_CHECKS)
settings.load_profile(os.environ.get("ZDSL_TEST_PROFILE", "zdsl"))


@pytest.fixture(scope="session")
def device():
    """lavapipe: the conformant CPU Vulkan driver every CI machine has after scripts/setup.sh.
    ZDSL_TEST_DEVICE names another (e.g. 0 on a GPU machine), to run the kernel tests on real
    hardware, where thousands of workgroups are in flight at once."""
    from zdsl.runtime import open_device

    dev = open_device(os.environ.get("ZDSL_TEST_DEVICE", "lavapipe"))
    yield dev
    dev.close()


@pytest.fixture(scope="session")
def pieced_device():
    """The same device told it binds 64 KiB at once (ZDSL_DEVICE_LIMITS), so that a buffer past
    that comes in pieces: the tiny models' output heads, token embeddings and expert stacks among
    them, and any kernel reading one reads across seams."""
    from zdsl.runtime import open_device

    with pytest.MonkeyPatch.context() as env:
        env.setenv("ZDSL_DEVICE_LIMITS", "binding=64KiB,allocation=256KiB")
        dev = open_device(os.environ.get("ZDSL_TEST_DEVICE", "lavapipe"))
    yield dev
    dev.close()


def pytest_collection_modifyitems(items):
    """Tests that run on a Vulkan device (the `device` fixtures, or a `lavapipe` or `device`
    parameter; those that open one through the command line are marked by hand) are marked
    `device`, so that `make test-quick` can leave them out. Tests marked `early` go first: the
    longest ones (minutes, on one worker), and under `--dist worksteal` (Makefile) the first of
    the collection starts on the first worker at once, so the other worker runs the rest beside
    it and nothing long is left for the end."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        fixtures, values = set(getattr(item, "fixturenames", ())), set(map(str, params.values()))
        if {"device", "pieced_device"} & fixtures or {"lavapipe", "device"} & values:
            item.add_marker(pytest.mark.device)
    early = [item for item in items if item.get_closest_marker("early")]
    if early:
        items[:] = early + [item for item in items if not item.get_closest_marker("early")]
