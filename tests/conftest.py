import os
import signal

from hypothesis import settings

# CI runs a fixed, reproducible set of examples; elsewhere hypothesis explores freely.
# HYPOTHESIS_PROFILE=thorough runs many more.
settings.register_profile("dev", max_examples=30)
settings.register_profile("ci", max_examples=30, derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_configure(config):
    """A shell ignores SIGINT for the commands it starts in the background, and a child inherits
    that: the Ctrl-C tests' commands would then never see their Ctrl-C. Run as if in the foreground."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
