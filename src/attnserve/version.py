"""attnserve's version, in one place: the package exports it, the CLI and the server report it."""

__version__ = "0.1.0"
