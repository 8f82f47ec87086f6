"""The OpenAI-compatible dialect that both servers speak (the pool's front door and
the reference decode server): requests read field by field (``request.py``,
``fields.py``) into their sampling parameters (``sampling_params.py``), refused with
``BadRequest`` (``errors.py``), chat messages rendered to prompt text (``chat.py``)
and tokenized (``tokenizer.py``), and the answers, whole or streamed, assembled
choice by choice (``choices.py``, ``answers.py``).

The bottom of the serving side: no I/O, no torch, no aiohttp, and nothing of
``server/``, ``decode/``, the runtime or the engine; they import it, never the
reverse. The HTTP answers these become are ``http_json.py``; the token choice over
logits is ``decode/sampling.py``."""
