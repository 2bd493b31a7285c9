"""spotnb's version: its own module, so reading it loads nothing else of the package."""

__version__ = "0.1.0"
