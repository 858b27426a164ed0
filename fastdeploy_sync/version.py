"""The package's version (the root package and ``fastdeploy-sync --version`` read it)."""

__version__ = "0.1.0"
