"""Test-wide settings: the verifier runs after every pass."""

import os

os.environ.setdefault("FLOWJIT_VERIFY", "1")
