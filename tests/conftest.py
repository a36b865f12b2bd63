import os

from hypothesis import settings

# CI runs a fixed, reproducible set of examples; elsewhere hypothesis explores freely.
# HYPOTHESIS_PROFILE=thorough runs many more.
settings.register_profile("dev", max_examples=30)
settings.register_profile("ci", max_examples=30, derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
