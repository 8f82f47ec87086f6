"""The command line: ``python -m vertumnus SUBCOMMAND`` (and the ``vertumnus`` script).

One module per subcommand, each with ``add_arguments(parser)`` and ``run(args) ->
exit code``: argument parsing and printing only; what they run lives beside the code
it drives (the engine, the profiler, the simulator, the coordinator).

Subcommands: ``prefill`` (one CP worker, one prefill, optional check against a
reference), ``fit`` (the execution-time model from measured samples), ``profile``
(measure the engine and fit), ``capacity`` (kappa_C per degree into a profile) and
``simulate`` (the policies at cluster scale, in simulation), ``serve`` (the REST
API), ``loadgen`` and ``decode``; ``agent`` only says what replaced it (Ray). Errors in
what the user gave print one line on stderr and exit 2; a failure of the rank
processes (``RanksError``) prints one line and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vertumnus.capacity import CapacityError
from vertumnus.cli import agent, capacity, decode, fit, loadgen, prefill, profile, serve, simulate
from vertumnus.config import ConfigError
from vertumnus.perfmodel import ProfileError
from vertumnus.slo import SloError
from vertumnus.traces import TraceError

# (name, one-line help, module with add_arguments(parser) and run(args) -> exit code)
COMMANDS = (
    ("prefill", "run one prefill on a CP worker of C ranks", prefill),
    ("fit", "fit the execution-time model E_C(R, P) from samples", fit),
    ("profile", "measure the engine on a grid and fit E_C(R, P) per degree", profile),
    ("capacity", "find each degree's capacity kappa_C and write it into a profile", capacity),
    ("simulate", "run the prefill pool's policies in a discrete-event simulation", simulate),
    ("serve", "serve prefills over a REST API (coordinator + rank processes)", serve),
    ("loadgen", "drive a running server with a trace or synthetic load", loadgen),
    ("agent", "removed: pools across hosts run on Ray (docs/multi-host.md)", agent),
    ("decode", "serve completions, decoding after a prefill pool's hand-off", decode),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vertumnus",
        description="Vertumnus: prefill pool for long-context LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary, module in COMMANDS:
        p = sub.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ConfigError, ProfileError, CapacityError, TraceError, SloError) as exc:
        print(f"vertumnus {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Imported here: the pool (and torch) loads only once a subcommand needs ranks.
        from vertumnus.runtime.ranks import RanksError

        if not isinstance(exc, RanksError):
            raise
        # The first line names the rank and its error; the rest is the rank's traceback.
        headline = str(exc).partition("\n")[0]
        print(f"vertumnus {args.command}: error: {headline}", file=sys.stderr)
        return 1
