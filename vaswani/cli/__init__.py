"""The `vaswani` command line (`main`); each subcommand is a module of this package."""

from .main import main

__all__ = ["main"]
