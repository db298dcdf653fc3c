"""How much the tests try: `make test` keeps within minutes on 2 cores, `make test-thorough`
(ZDSL_TEST_PROFILE=thorough; conftest.py loads the hypothesis profile) tries ten times the
examples and, on a device, every variant a test draws."""

import os

THOROUGH = os.environ.get("ZDSL_TEST_PROFILE") == "thorough"


def examples(n: int) -> int:
    """A test's hypothesis examples: n, or ten times n in the thorough profile."""
    return 10 * n if THOROUGH else n
