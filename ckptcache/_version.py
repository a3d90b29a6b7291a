"""The package version, in a module of its own so the daemon can read it without the client."""

__version__ = "0.1.0"
