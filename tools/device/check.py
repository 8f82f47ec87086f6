"""The device check: what a CPU cannot measure, in one command on one GPU.

    tools/device_check.sh [--dry-run] [--out DIR] [--peak-tflops T] [--budget-s S]

(the shell script finds or sets up the Python environment and runs this file). In
order, each step timed and guarded (a failing step is recorded with its error, and
the next ones run):

1. exactness: the engine's C = 1 prefill against transformers on CUDA, dense and
   MoE, fp32 and bf16, without and with a cached prefix (``exactness.py``);
2. prefill: Qwen3-30B-A3B's shape (48 layers, random bf16 weights drawn on the
   GPU) at 1K, 8K and 32K tokens and two prefix-cached points: time, MFU, against
   transformers on the same tensors and the shipped profile's E_1 (``speed.py``);
3. profile: the measured degree-1 profile fitted to those timings and written
   beside the JSON (``profile_fit.py``);
4. host link: the host tier's both ways and a hand-off's device to host (``host.py``);
5. rank: ``serve``'s rank process on the device, its staging and its CUDA-event
   timing, exact in fp32 with and without a prefix from its store (``rank_path.py``);
6. CP across ranks: skipped, with the reason (one GPU is one rank).

``--dry-run`` runs the same code on the CPU with small shapes (a 2-layer ``tiny-moe``
for the speed step, lengths 64-256, a nominal peak), in well under a minute. Writes
``DIR/device_check.json`` (rewritten after every step, so a killed run leaves what
it measured) and the profile, and prints the table of figures, targets and verdicts
(``table.py``). Exit status 1 when a step failed to run, else 0: a missed target is
a finding of the check, recorded as FAIL, not a failure of the check.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers

from tools.device import exactness, host, profile_fit, rank_path, speed, table
from tools.device.common import device_name, peak_flops, run_step
from vertumnus.config import PRESETS, ModelConfig

JSON_NAME = "device_check.json"
QWEN3_30B_A3B = replace(PRESETS["qwen3-30b-a3b-2l"], num_hidden_layers=48, name="qwen3-30b-a3b")
TINY_MOE_2L = replace(PRESETS["tiny-moe"], num_hidden_layers=2, name="tiny-moe-2l")


@dataclass(frozen=True)
class Plan:
    """Every size of one run of the check."""

    exact_length: int  # tokens of each exactness prompt
    exact_prefix: int  # its cached prefix in the prefix cases
    speed_model: ModelConfig
    full_shape: bool  # speed_model is the shipped profile's model
    lengths: tuple[int, ...]
    prefix_points: tuple[tuple[int, int], ...]  # (uncached R, cached P)
    block: int  # the speed step's and the host link's KV block
    repeats: int
    slow_s: float  # a transformers warm-up past this: "too slow"
    link_bytes: int
    link_repeats: int
    handoff_tokens: int
    budget_s: float  # no speed point starts after this many seconds
    exact_presets: tuple[str, ...] = ("tiny", "tiny-moe")
    exact_block: int = 16
    notes: dict[str, str] = field(default_factory=dict)


DEVICE_PLAN = Plan(
    exact_length=1500,
    exact_prefix=1024,
    speed_model=QWEN3_30B_A3B,
    full_shape=True,
    lengths=(1024, 8192, 32768),
    prefix_points=((2048, 6144), (1024, 15360)),
    block=512,  # the shipped profile's
    repeats=3,
    slow_s=60.0,
    link_bytes=64 << 20,
    link_repeats=5,
    handoff_tokens=8192,
    budget_s=300.0,  # about 2 minutes expected: a guard that keeps the whole under 8
)
DRY_PLAN = Plan(
    exact_length=157,
    exact_prefix=96,
    speed_model=TINY_MOE_2L,
    full_shape=False,
    lengths=(64, 128, 256),
    prefix_points=((64, 128), (32, 224)),
    block=16,
    repeats=2,
    slow_s=30.0,
    link_bytes=1 << 20,
    link_repeats=2,
    handoff_tokens=256,
    budget_s=300.0,
    notes={"speed_model": "a 2-layer tiny-moe instead of the 48-layer Qwen3-30B-A3B"},
)


def cp_step(device: torch.device, dry_run: bool) -> dict[str, Any]:
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if dry_run:
        reason = "dry run on CPU; on the device one GPU is one rank, so NCCL CP cannot run"
    elif count < 2:
        reason = (
            f"{count} GPU on this machine: CP runs one rank per GPU and a degree-C worker "
            "needs C GPUs over NCCL, so no degree > 1 can run here"
        )
    else:
        reason = (
            f"this check measures one GPU of {count}: for CP over them run "
            "`python -m vertumnus profile --device cuda --degrees 1,2,4`"
        )
    return {"status": "skipped", "reason": reason, "gpus": count, "seconds": 0.0}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, small shapes, nominal peak")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak override")
    p.add_argument("--budget-s", type=float, default=None, help="no speed point starts after")
    p.add_argument("--env-note", default="", help="how the environment was found (the script)")
    p.add_argument("--command", default="tools/device_check.sh", help="recorded as given")
    return p.parse_args(argv)


def write(report: dict[str, Any], out: Path) -> Path:
    path = out / JSON_NAME
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = DRY_PLAN if args.dry_run else DEVICE_PLAN
    if args.budget_s is not None:
        plan = replace(plan, budget_s=args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    start, started = time.monotonic(), dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.dry_run:
        device = torch.device("cpu")
    name = device_name(device)
    peak = peak_flops(name, args.peak_tflops, nominal=args.dry_run)
    plan_record = asdict(plan)
    plan_record["speed_model"] = plan.speed_model.name
    report: dict[str, Any] = {
        "dry_run": args.dry_run,
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "env": args.env_note,
        "command": args.command,
        "started": started,
        "peak": peak,
        "plan": plan_record,
        "steps": {},
    }
    steps: dict[str, Any] = report["steps"]
    print(f"[device-check] {name}, torch {torch.__version__}, dry run: {args.dry_run}", flush=True)
    if not args.dry_run and not cuda:
        why = "CUDA is not available to this Python (see env): nothing measured on a GPU"
        for step in ("exactness", "prefill", "profile", "host_link", "rank"):
            steps[step] = {"status": "error", "error": why, "seconds": 0.0}
    else:
        run_all(plan, device, name, peak, steps, args, start, report)
    steps["cp"] = cp_step(device, args.dry_run)
    report["targets"] = table.rows(report)
    report["summary"] = {
        verdict: sum(r["result"] == verdict for r in report["targets"])
        for verdict in ("PASS", "FAIL", "SKIP", "INFO")
    }
    report["steps_ran"] = all(s["status"] in ("ok", "skipped") for s in steps.values())
    report["wall_s"] = round(time.monotonic() - start, 2)
    path = write(report, args.out)
    print(table.render(report["targets"]))
    print(f"[device-check] {report['summary']}; {report['wall_s']} s; wrote {path}", flush=True)
    return 0 if report["steps_ran"] else 1


def run_all(
    plan: Plan,
    device: torch.device,
    name: str,
    peak: dict[str, Any],
    steps: dict[str, Any],
    args: argparse.Namespace,
    start: float,
    report: dict[str, Any],
) -> None:
    run_step(
        steps,
        "exactness",
        device,
        lambda: exactness.run(
            device, plan.exact_presets, plan.exact_length, plan.exact_prefix, plan.exact_block
        ),
    )
    write(report, args.out)
    run_step(
        steps,
        "prefill",
        device,
        lambda: speed.run(
            plan.speed_model,
            device,
            plan.lengths,
            plan.prefix_points,
            plan.block,
            plan.repeats,
            peak,
            deadline=start + plan.budget_s,
            slow_s=plan.slow_s,
            full_shape=plan.full_shape,
        ),
    )
    write(report, args.out)
    run_step(
        steps,
        "profile",
        device,
        lambda: profile_fit.run(steps["prefill"], args.out, name, args.dry_run, args.command),
    )
    write(report, args.out)
    run_step(
        steps,
        "host_link",
        device,
        lambda: host.run(
            plan.speed_model,
            device,
            plan.block,
            plan.link_bytes,
            plan.link_repeats,
            plan.handoff_tokens,
            steps["profile"].get("path"),
        ),
    )
    write(report, args.out)
    run_step(steps, "rank", device, lambda: rank_path.run(device))


if __name__ == "__main__":
    raise SystemExit(main())
