"""The streaming service: scheduler, engine, sessions, encoding, transports, server and CLI."""

__version__ = "0.1.0"
