"""Shared fixtures: one lavapipe device per test session, a private cache directory."""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Tests never touch the user's cache. The directory is made once per session: pytest loads this
# file in the xdist controller too, and the workers inherit its environment, so they share it
# (entries are written atomically; a SPIR-V module compiled by one worker is read by the other).
os.environ.setdefault("ZDSL_CACHE_DIR", tempfile.mkdtemp(prefix="zdsl-test-cache-"))

settings.register_profile("zdsl", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("zdsl")


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
    """Tests marked `early` first: the whole registry's build is the suite's longest test (minutes,
    on worker processes of its own), and under `--dist worksteal` (Makefile) the first of the
    collection starts on the first worker at once, so the other worker runs the rest beside it
    and nothing long is left for the end."""
    early = [item for item in items if item.get_closest_marker("early")]
    if early:
        items[:] = early + [item for item in items if not item.get_closest_marker("early")]
