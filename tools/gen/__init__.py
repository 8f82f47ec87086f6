"""Generated files: ``python -m tools.gen.NAME`` writes what it names."""
