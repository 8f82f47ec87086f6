"""The load generator as a script: the same as ``python -m vertumnus loadgen``.

    .venv/bin/python -m tools.gen.loadgen --url http://127.0.0.1:8000 \\
        --trace ../shared/traces/conversation_trace.jsonl --length-scale 0.03125 \\
        --num-requests 500 --rate-scale 10 --out result.json
"""

from __future__ import annotations

import sys

from vertumnus.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["loadgen", *sys.argv[1:]]))
