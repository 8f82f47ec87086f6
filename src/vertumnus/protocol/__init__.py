"""The OpenAI-compatible dialect that both servers speak (the pool's front door and
the reference decode server): requests read field by field (``request.py``), chat
messages rendered to prompt text (``chat.py``), and the answers, whole or streamed,
assembled choice by choice (``choices.py``, ``answers.py``). No I/O here."""
