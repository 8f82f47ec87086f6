"""DeepSeek-V4 in the engine: its own decoder (``model.py``, ``layers.py``), its
attention arithmetic (``compress.py``) and its partitioned zigzag CP (``zigzag.py``)."""
