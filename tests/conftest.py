"""What every test process shares: one torch thread, hypothesis profiles, a foreground SIGINT and
the service fixtures (tests/support/fixtures.py)."""

import os
import signal
from pathlib import Path

# One intra-op (OpenMP) thread per test process and per process a test starts, set before torch is
# first imported: the tests' matrices are tiny and the test processes share the machine's cores,
# where OpenMP threads spin at barriers while a core is taken. With two test processes on two
# cores, the optimizer and engine tests took 4.8x longer at two threads each than at one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import settings

# CI runs a fixed, reproducible set of examples; elsewhere hypothesis explores freely.
# HYPOTHESIS_PROFILE=thorough runs many more.
settings.register_profile("dev", max_examples=30)
settings.register_profile("ci", max_examples=30, derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# A test that uses one of these fixtures runs the service's processes: it is a system test.
PROCESS_FIXTURES = frozenset({"api_url", "worker", "start_worker", "shared_worker"})
BROWSER_TESTS = Path(__file__).parent / "browser"


def pytest_collection_modifyitems(items):
    """Mark what `make test-fast` leaves out: ``browser`` (every test under tests/browser) and
    ``system`` (those too, and every test that uses a fixture in PROCESS_FIXTURES; modules whose
    tests start processes otherwise say so with a module-level ``pytestmark``)."""
    for item in items:
        if BROWSER_TESTS in item.path.parents:
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.system)
        elif PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)
    # The modules with system tests first (the longest: they wait on real processes), each module's
    # tests together and in order: the test processes, handed one module at a time, then end together.
    waits = {item.path for item in items if item.get_closest_marker("system")}
    items.sort(key=lambda item: item.path not in waits)


def pytest_configure(config):
    """A shell ignores SIGINT for the commands it starts in the background, and a child inherits
    that: the Ctrl-C tests' commands would then never see their Ctrl-C. Run as if in the foreground."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


pytest_plugins = ("tests.support.fixtures",)
