"""The simulator's experiments and their reports: ``python -m tools.experiments.NAME``."""
