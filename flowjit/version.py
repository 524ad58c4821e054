"""flowjit's version: one home, read by the package and by the compile cache's key."""

__version__ = "0.1.0"
