"""The measuring commands above the engine: `verify` and `audit` (losslessness), `bench` (speed).
They build their backends and debug hooks themselves and decode through engine.decode."""
