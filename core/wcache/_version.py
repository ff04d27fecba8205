"""The package's version, its one owner (`wcache.__version__` re-exports it; pyproject.toml reads it from here)."""

__version__ = "0.1.0"
