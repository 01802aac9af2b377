"""The engine's exception, in a module of its own so that the engine's parts (streamsvc/engine/parking.py) raise it
without importing the engine."""


class EngineError(RuntimeError):
    """The engine was used against its contract (unknown stream, not running, ...)."""
