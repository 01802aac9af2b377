"""The engine's exception, in a module of its own so that the engine's parts (streamsvc/engine/parking.py) raise it
without importing the engine. Import it from streamsvc.engine.engine, which re-exports it."""


class EngineError(RuntimeError):
    """The engine was used against its contract (unknown stream, not running, ...)."""
