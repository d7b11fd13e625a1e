"""The dashboard: an ASGI app over a fleet (needs the ``dashboard`` extra)."""

from .app import create_app as create_app

__all__ = ("create_app",)
