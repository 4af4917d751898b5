"""Blazar: a local AI inference gateway."""

__version__ = "0.1.0"
