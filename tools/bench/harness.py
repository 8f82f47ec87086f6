"""What every benchmark under ``tools/bench/`` shares: the machine and the source it
ran on, the guard against other processes' load, timing helpers, and the JSON it
writes. (Starting a server to measure is ``_serving.py``'s.)

A benchmark adds the harness's options to its parser (``add_arguments``: ``--json
PATH``, ``--max-foreign``, ``--max-wait``, and ``--retries`` where it times runs one
by one), opens a ``Session`` before it measures and hands its figures to
``Session.finish`` at the end. The JSON then holds, beside the figures:

* ``machine``: ``fingerprint()``, taken at the start: CPU model, cores (and those
  this process may use), memory, Python, the platform, torch and transformers
  versions (and torch's threads where the benchmark imported torch), the git commit
  of the checkout the ``vertumnus`` package was imported from and whether ``src/``,
  ``tools/`` or ``configs/`` had uncommitted changes, and ``src_sha256``, a hash of
  every ``.py`` file of that package;
* ``run``: the benchmark, its command line, the start time, its wall time, the
  cores other processes used on average over it (``others_cores``), how long it
  waited for a quiet machine, and whether the package's source changed meanwhile.

The guard (``Load``): the machine may be shared. Before it measures, a session waits
(at most ``--max-wait`` s) until other processes use fewer than ``--max-foreign``
cores; it reports what they used over the whole run, and warns when that was more.
Benchmarks that time runs one by one (``interleaved``) also redo a run during which
others were busy (at most ``--retries`` times, then keep it and flag it). "Others"
is every process outside this one and its descendants (the ranks, servers, Ray
nodes and browsers it starts as descendants are its own). A descendant orphaned by
its parent's end (vLLM's engine core when its process group is stopped) is
reparented to init and its time lost to "others", unless the benchmark calls
``adopt_orphans()`` first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

import vertumnus
from vertumnus.stats import percentile

Snapshot = tuple[float, int, int, int]  # wall s, machine busy and steal jiffies, own jiffies


def src_sha256() -> str:
    """sha256 (12 hex digits) of the ``vertumnus`` package's source files, as imported."""
    root = Path(vertumnus.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def fingerprint() -> dict[str, Any]:
    """The machine and the source a benchmark runs on (see the module's docstring)."""
    package = Path(vertumnus.__file__).parent
    commit = _git(package, "rev-parse", "--short=12", "HEAD")
    dirty = _git(package, "status", "--porcelain", "--", ":/src", ":/tools", ":/configs")
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info: dict[str, Any] = {
        "git_commit": commit,
        "git_dirty": None if dirty is None else bool(dirty),
        "src": str(package),
        "src_sha256": src_sha256(),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }
    torch = sys.modules.get("torch")  # its threads only where the benchmark uses it
    if torch is not None:
        info["torch_num_threads"] = torch.get_num_threads()
        info["torch_num_interop_threads"] = torch.get_num_interop_threads()
        info["mkldnn"] = torch.backends.mkldnn.is_available()
    return info


PR_SET_CHILD_SUBREAPER = 36


def command_line() -> str:
    """This process's command: ``python -m tools.bench.NAME ARGS`` for a tool run as a
    module (``sys.argv[0]`` is then the module's file), else the script and its args."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return " ".join([os.path.basename(sys.executable), *head, *sys.argv[1:]])


def adopt_orphans() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so that they
    stay in its tree, and their CPU time its own, until it ends. Their zombies are
    left for its end: call it in a benchmark's main process, not in a long-lived one.
    False where the system does not allow it."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


class Load:
    """CPU use of the whole machine and of this process tree, from /proc: the guard
    against other processes' load (``max_foreign`` cores, see the module)."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, max_foreign: float, max_wait_s: float, retries: int = 0) -> None:
        self.max_foreign, self.max_wait_s, self.retries = max_foreign, max_wait_s, retries
        self.available = os.path.exists("/proc/stat")

    @staticmethod
    def _machine() -> tuple[int, int]:
        """(busy jiffies, steal jiffies) summed over all CPUs."""
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return v[0] + v[1] + v[2] + v[5] + v[6], v[7] if len(v) > 7 else 0

    @staticmethod
    def _own() -> int:
        """CPU jiffies of this process and its live descendants, with those of the
        children they reaped (a rank pool closed during the run is still its own)."""
        procs: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            # ppid; utime, stime, and cutime, cstime: the reaped children's
            procs[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
        mine, frontier, total = {os.getpid()}, [os.getpid()], 0
        while frontier:
            pid = frontier.pop()
            total += procs.get(pid, (0, 0))[1]
            for child, (ppid, _) in procs.items():
                if ppid == pid and child not in mine:
                    mine.add(child)
                    frontier.append(child)
        return total

    def snapshot(self) -> Snapshot:
        if not self.available:
            return time.perf_counter(), 0, 0, 0
        busy, steal = self._machine()
        return time.perf_counter(), busy, steal, self._own()

    def foreign(self, a: Snapshot, b: Snapshot) -> float:
        """Average cores used by other processes between two snapshots."""
        wall = b[0] - a[0]
        if not self.available or wall <= 0:
            return 0.0
        return max(0.0, ((b[1] - a[1]) - (b[3] - a[3])) / self.TICK / wall)

    def steal(self, a: Snapshot, b: Snapshot) -> float:
        """Average cores stolen by the hypervisor between two snapshots."""
        return (b[2] - a[2]) / self.TICK / max(b[0] - a[0], 1e-9)

    def wait_quiet(self) -> float:
        """Wait (at most max_wait_s) until others use < max_foreign cores over 1 s;
        returns what they used over the last second (0 without a wait)."""
        if not self.available or self.max_wait_s <= 0:
            return 0.0
        deadline = time.monotonic() + self.max_wait_s
        while True:
            a = self.snapshot()
            time.sleep(1.0)
            f = self.foreign(a, self.snapshot())
            if f < self.max_foreign or time.monotonic() >= deadline:
                return f


@dataclass
class Timed:
    """The kept timed runs of one configuration (seconds)."""

    runs: list[float] = field(default_factory=list)
    details: list[Any] = field(default_factory=list)  # what each run returned beside its time
    foreign: list[float] = field(default_factory=list)  # cores used by others, per run
    discarded: int = 0  # runs redone because other processes were busy
    flagged: int = 0  # runs kept although other processes were busy (retries exhausted)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median,
            "runs_s": self.runs,
            "others_cores_per_run": self.foreign,
            "discarded_runs": self.discarded,
            "flagged_runs": self.flagged,
        }


Runner = Callable[[], tuple[float, Any]]  # one run: (seconds, anything else it returns)


def interleaved(
    runners: Mapping[str, Runner],
    repeats: int,
    load: Load,
    describe: Callable[[Any], str] = lambda _: "",
) -> tuple[dict[str, Timed], dict[str, Any]]:
    """Warm each runner up once, then ``repeats`` timed rounds of one run each: the
    timed runs, and what each warm-up returned beside its time.

    The order within a round reverses every round (A B, B A, A B, ...), so that
    neither configuration always runs right after the other. Each timed run waits
    for a quiet machine first; a run during which other processes used more than
    ``load.max_foreign`` cores is discarded and redone (at most ``load.retries``
    times per run; after that it is kept and flagged). ``describe`` turns what a
    run returned into the end of its printed line.
    """
    timed = {name: Timed() for name in runners}
    warm: dict[str, Any] = {}
    for name, run in runners.items():
        t, warm[name] = run()
        print(f"    warm-up {name:<18} {t:8.3f} s", flush=True)
    for i in range(repeats):
        order = list(runners.items())
        for name, run in order if i % 2 == 0 else reversed(order):
            for attempt in range(load.retries + 1):
                load.wait_quiet()
                before = load.snapshot()
                t, detail = run()
                after = load.snapshot()
                foreign, steal = load.foreign(before, after), load.steal(before, after)
                clean = foreign <= load.max_foreign
                note = "" if clean else "  DISCARDED: " if attempt < load.retries else "  FLAGGED: "
                if note:
                    note += f"other processes used {foreign:.2f} cores"
                print(
                    f"    run {i + 1}/{repeats} {name:<18} {t:8.3f} s{describe(detail)}"
                    f"  [others {foreign:.2f} cores, steal {steal:.2f}]{note}",
                    flush=True,
                )
                if clean or attempt == load.retries:
                    timed[name].runs.append(t)
                    timed[name].details.append(detail)
                    timed[name].foreign.append(foreign)
                    timed[name].flagged += not clean
                    break
                timed[name].discarded += 1
    return timed, warm


def summary(values: Sequence[float]) -> dict[str, float | int]:
    """How many, mean, median, P90, P99, least and most of ``values`` (in the unit
    of the key they are written under)."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def add_arguments(
    parser: argparse.ArgumentParser,
    json_option: bool = True,
    retries: bool = False,
    max_wait_s: float = 300.0,
) -> None:
    """The harness's options: ``--json PATH`` (unless the benchmark writes its JSON
    under an option of its own), the guard's ``--max-foreign`` and ``--max-wait``,
    and ``--retries`` for a benchmark whose runs are redone (``interleaved``)."""
    if json_option:
        parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        help="cores other processes may use while this measures (else: warned, or redone)",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=max_wait_s,
        help="longest wait (s) for a quiet machine before measuring (0: do not wait)",
    )
    if retries:
        parser.add_argument("--retries", type=int, default=5, help="redos per timed run")


class Session:
    """One run of a benchmark: the fingerprint and the start, taken once the machine
    is quiet (or ``--max-wait`` has passed); ``finish`` writes the JSON."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.load = Load(args.max_foreign, args.max_wait, getattr(args, "retries", 0))
        self.machine = fingerprint()
        self.started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        m = self.machine
        print(
            f"machine: {m['cpu']}, {m['cores_usable']} of {m['cores']} cores, "
            f"{m['memory_gib']} GiB; Python {m['python']}, torch {m['torch']}",
            flush=True,
        )
        dirty = " + uncommitted changes" if m["git_dirty"] else ""
        print(f"source: {m['src']} at {m['git_commit']}{dirty}, src_sha256 {m['src_sha256']}")
        waiting = time.perf_counter()
        self.load.wait_quiet()
        self.waited_s = time.perf_counter() - waiting
        self.began = self.load.snapshot()

    def document(self, figures: Mapping[str, Any]) -> dict[str, Any]:
        """``figures`` with ``machine`` and ``run`` (see the module); warns when other
        processes were busy or the source changed during the run."""
        assert not {"machine", "run"} & set(figures), "machine and run are the harness's"
        end = self.load.snapshot()
        others = self.load.foreign(self.began, end)
        changed = src_sha256() != self.machine["src_sha256"]
        if others > self.load.max_foreign:
            print(
                f"WARNING: other processes used {others:.2f} cores on average during the run "
                f"(--max-foreign {self.load.max_foreign}): the figures may be slowed"
            )
        if changed:
            print("WARNING: the package's source changed during the run: figures may mix versions")
        run = {
            "benchmark": self.name,
            "command": command_line(),
            "started": self.started,
            "wall_s": end[0] - self.began[0],
            "others_cores": others,
            "max_foreign": self.load.max_foreign,
            "waited_s": self.waited_s,
            "source_changed": changed,
        }
        return {"machine": self.machine, "run": run, **figures}

    def finish(self, path: str | Path | None, figures: Mapping[str, Any]) -> dict[str, Any]:
        """The document of ``figures``, written to ``path`` as JSON when one is given."""
        doc = self.document(figures)
        if path is not None:
            out = Path(path)
            out.parent.mkdir(parents=True, exist_ok=True)
            option = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
            out.write_bytes(orjson.dumps(doc, option=option, default=str))
            print(f"figures written to {out}")
        return doc
