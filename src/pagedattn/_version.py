"""The package's version, below every module that reads it."""

__version__ = "0.1.0"
