"""Test-wide settings: the verifier runs after every pass."""

import os

os.environ.setdefault("FLOWJIT_VERIFY", "1")

# The CPU backend's disk cache goes to a fresh folder per test session, never the user's ~/.cache.
import tempfile  # noqa: E402

os.environ.setdefault("FLOWJIT_CACHE_DIR", tempfile.mkdtemp(prefix="flowjit-test-cache-"))
