"""Load generator: replay a trace or a synthetic workload against the REST API.

The requests come from ``workloads`` (a trace, random lengths or shared-prefix
groups, with the trace's arrivals or Poisson or gamma ones); ``client`` sends them
open-loop at their arrival times, as prefills or as streamed generations, and
measures each; ``report`` summarises the outcomes under the field names of
``vllm bench serve``. The CLI (``vertumnus loadgen``) and the end-to-end bench use
the names re-exported here.
"""

from vertumnus.loadgen.client import LoadResult, Outcome, run, terminal_progress
from vertumnus.loadgen.report import summarize, text_summary
from vertumnus.loadgen.workloads import (
    LoadRequest,
    block_of,
    from_trace,
    synthetic,
    with_arrivals,
)

__all__ = [
    "LoadRequest",
    "LoadResult",
    "Outcome",
    "block_of",
    "from_trace",
    "run",
    "summarize",
    "synthetic",
    "terminal_progress",
    "text_summary",
    "with_arrivals",
]
