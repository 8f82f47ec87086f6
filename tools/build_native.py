"""Compile the hot policy modules with mypyc into this environment (``vertumnus.native``).

    .venv/bin/python -m tools.build_native [--force] [--check]

For each module in ``vertumnus.native.MODULES``: its source, with the SHA-256 of
that source appended as ``SOURCE_SHA256``, is compiled by mypyc (from mypy, in the
test extra; a C compiler and the Python headers are needed) into the top-level
extension ``_vertumnus_native_<name>`` in this interpreter's site-packages. A twin
already built from the same source is kept (``--force`` builds it again). The
package runs the pure module wherever no matching twin is installed, so a failed
build costs speed, never correctness: the exit status is 1 then, and ``setup.sh``
warns and goes on. ``--check`` builds nothing and exits 1 unless every twin is
current.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from vertumnus import native

SRC = Path(native.__file__).resolve().parents[1]


def installed_hash(twin: str) -> str | None:
    """The source hash recorded by the installed twin, read in a fresh interpreter
    (an extension, once imported, cannot be reloaded)."""
    if importlib.util.find_spec(twin) is None:
        return None
    out = subprocess.run(
        [sys.executable, "-c", f"import {twin}; print({twin}.SOURCE_SHA256)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def source_of(name: str) -> Path:
    """The source file of ``name``, a dotted name under ``vertumnus.policy``."""
    return SRC / "vertumnus" / "policy" / f"{name.replace('.', '/')}.py"


def build(name: str, dest: Path) -> None:
    source = source_of(name)
    twin = native.twin_name(name)
    digest = native.source_hash(source)
    with tempfile.TemporaryDirectory(prefix="vertumnus-native-") as tmp:
        work = Path(tmp)
        text = source.read_text()
        (work / f"{twin}.py").write_text(f'{text}\n\nSOURCE_SHA256 = "{digest}"\n')
        env = dict(os.environ, MYPYPATH=str(SRC))
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", f"{twin}.py"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed on {source.name}:\n{done.stdout}{done.stderr}")
        built = sorted(work.glob(f"{twin}*.so")) + sorted(work.glob(f"{twin}*.pyd"))
        if not built:
            raise RuntimeError(f"mypyc left no extension for {source.name} in {work}")
        for lib in built:
            # A new file renamed over the old one: a process that has the old one
            # loaded keeps its own (overwriting a loaded library in place crashes it).
            part = dest / f".{lib.name}.part"
            shutil.copy2(lib, part)
            os.replace(part, dest / lib.name)
    if installed_hash(twin) != digest:
        raise RuntimeError(f"{twin} was built but does not import with its source hash")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--force", action="store_true", help="build even if current")
    parser.add_argument("--check", action="store_true", help="only report; 1 if any is stale")
    args = parser.parse_args()
    dest = Path(sysconfig.get_paths()["platlib"])
    failed = 0
    for name in native.MODULES:
        twin = native.twin_name(name)
        digest = native.source_hash(source_of(name))
        current = installed_hash(twin) == digest
        if args.check or (current and not args.force):
            print(f"{name}: {'compiled, current' if current else 'not built for this source'}")
            failed += not current
            continue
        try:
            build(name, dest)
        except (RuntimeError, OSError) as exc:
            print(f"{name}: not compiled, it runs as pure Python: {exc}", file=sys.stderr)
            failed += 1
        else:
            print(f"{name}: compiled into {dest}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
