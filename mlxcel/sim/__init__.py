"""Whole clusters in one process, on a virtual clock and an in-memory network, with seeded
faults: the production roles and adapters, run as they serve (docs/simulation.md)."""
