"""Routing sources for decode benchmarks and the CPU replay: the model's own routers, a recorded
trace, or a calibrated generator (docs/routing.md)."""
