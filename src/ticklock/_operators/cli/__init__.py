"""The command line: ``ticklock`` (also ``python -m ticklock``)."""

from .main import main

__all__ = ["main"]
