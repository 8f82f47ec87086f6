"""Helpers shared by every test folder: factories, reference checkpoints, the thread
and process harnesses. Imported as ``support.<module>`` (pyproject.toml puts tests/
on ``pythonpath``). pytest does not rewrite assertions here: give them messages."""
