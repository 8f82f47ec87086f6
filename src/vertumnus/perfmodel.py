"""Execution-time model E_C(R, P): prediction, fitting, profiles on disk.

Owns the formula every predicted second in Vertumnus comes from (docs/gpu-profile.md,
"Coefficients"):

    W(R, P)   = R*P + R*(R+1)/2                      # remaining attention work
    E_C(R, P) = d_C + a_C*R + b_C*P + (c_C*R + alpha_C*W(R, P)) / C

with non-negative coefficients per (model, hardware, degree): ``d`` start-up (s),
``a`` per-token cost that does not shrink with C (s/token), ``b`` prefix access
(s/token), ``c`` token-local compute split over the ranks (s/token), ``alpha``
attention (s/token pair). Fitting is non-negative least squares on *relative* error
(each sample's row divided by its measured time), so short and long requests count
alike. Prediction is pure Python (the scheduler and simulator call it per request);
only fitting imports numpy and scipy.

W above is a layer of full causal attention; a model with other layers (sliding
windows, DeepSeek-V4's compressed attention) has its own W, the average over its
layers' kinds (``attention_work.AttentionMix``, where each kind's W is defined). The mix
rides on every degree's coefficients (so the policy's ``ReuseCurve`` sees it) and is
stored once in a profile's JSON (``"attention"``; absent: every layer full).

Not owned here: measuring samples on the engine (``profile``) and capacity
(``capacity``), which produce the inputs and the ``capacity`` section of a profile; a
model's mix (``config.model.attention_mix``: the configuration imports this module,
never the reverse).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from vertumnus.attention_work import FULL as FULL
from vertumnus.attention_work import AttentionMix as AttentionMix
from vertumnus.attention_work import Compressed as Compressed
from vertumnus.attention_work import ProfileError as ProfileError
from vertumnus.attention_work import attention_work as attention_work
from vertumnus.attention_work import window_work as window_work

COEFF_NAMES = ("d", "a", "b", "c", "alpha")
CSV_HEADER = ("degree", "uncached_tokens", "cached_tokens", "seconds")


@dataclass(frozen=True)
class DegreeCoeffs:
    d: float = 0.0  # s
    a: float = 0.0  # s / token, not divided by C
    b: float = 0.0  # s / cached token
    c: float = 0.0  # s / token, divided by C
    alpha: float = 0.0  # s / token pair, divided by C
    attention: AttentionMix = FULL  # the model's layers: what W counts

    def __post_init__(self) -> None:
        for name in COEFF_NAMES:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ProfileError(f"coefficient {name} must be finite and >= 0, got {value!r}")

    def predict(self, cp_degree: int, uncached_tokens: int, cached_tokens: int) -> float:
        """E_C(R, P) in seconds."""
        r, p = uncached_tokens, cached_tokens
        return (
            self.d
            + self.a * r
            + self.b * p
            + (self.c * r + self.alpha * self.attention.work(r, p)) / cp_degree
        )

    def to_json(self) -> dict[str, float]:
        """The coefficients by name (the mix is the profile's, stored once)."""
        return {n: getattr(self, n) for n in COEFF_NAMES}


@dataclass(frozen=True)
class Sample:
    cp_degree: int
    uncached_tokens: int
    cached_tokens: int
    seconds: float


def _features(s: Sample, attention: AttentionMix) -> list[float]:
    """Columns for d, c, b, alpha. Within one degree, a*R and c*R/C are the same column,
    so a per-degree fit cannot tell them apart: it reports the whole per-token term as
    ``c`` (``a`` = 0), which predicts the same E_C. ``a`` stays in the model for
    profiles derived from a model of the hardware (where the split is known)."""
    c = s.cp_degree
    return [
        1.0,
        s.uncached_tokens / c,
        float(s.cached_tokens),
        attention.work(s.uncached_tokens, s.cached_tokens) / c,
    ]


def fit_degree(samples: list[Sample], attention: AttentionMix = FULL) -> DegreeCoeffs:
    """Non-negative least squares on relative error: min sum_i (E(x_i)/y_i - 1)^2,
    alpha against the work W of the model's ``attention`` mix."""
    import numpy as np
    from scipy.optimize import nnls  # type: ignore[import-untyped]

    degrees = {s.cp_degree for s in samples}
    if len(degrees) != 1:
        raise ProfileError(f"fit_degree takes samples of one degree, got {sorted(degrees)}")
    if len(samples) < 4:
        raise ProfileError(f"degree {degrees.pop()}: {len(samples)} samples, need at least 4")
    x = np.array([_features(s, attention) for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    rows = x / y[:, None]
    # Columns span ~10 orders of magnitude (1 vs R*P): scale them for a stable solve.
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(rows / scale, np.ones_like(y), maxiter=50 * x.shape[1])
    d, c, b, alpha = (float(v) for v in solution / scale)
    return DegreeCoeffs(d=d, a=0.0, b=b, c=c, alpha=alpha, attention=attention)


def mape(coeffs: DegreeCoeffs, samples: Iterable[Sample]) -> float:
    """Mean absolute percentage error of ``coeffs`` on ``samples`` (a fraction)."""
    errors = [
        abs(coeffs.predict(s.cp_degree, s.uncached_tokens, s.cached_tokens) - s.seconds) / s.seconds
        for s in samples
    ]
    return sum(errors) / len(errors) if errors else float("nan")


@dataclass
class Profile:
    """Per-degree coefficients of one (model, hardware), as stored in a JSON file.
    Every degree's coefficients carry the model's attention mix (``attention``)."""

    model: str
    hardware: str
    block_size: int
    coeffs: dict[int, DegreeCoeffs]
    mape: dict[int, float] = field(default_factory=dict)
    capacity: dict[int, dict[str, Any]] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    # The host link, for the host KV tier: kv_bytes_per_token, d2h_bytes_s,
    # h2d_bytes_s (measured by ``profile``, or documented defaults), and how
    # ("measured" or "documented")
    host_link: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.attention  # noqa: B018 (raises if the degrees' mixes differ)

    @property
    def degrees(self) -> list[int]:
        return sorted(self.coeffs)

    @property
    def attention(self) -> AttentionMix:
        """The model's attention mix, shared by every degree's coefficients."""
        mixes = {k.attention for k in self.coeffs.values()}
        if len(mixes) > 1:
            raise ProfileError(f"profile {self.model}: degrees with different attention mixes")
        return mixes.pop() if mixes else FULL

    def predict(self, cp_degree: int, uncached_tokens: int, cached_tokens: int) -> float:
        try:
            coeffs = self.coeffs[cp_degree]
        except KeyError:
            raise ProfileError(
                f"profile {self.model}/{self.hardware} has no degree "
                f"{cp_degree} (has {self.degrees})"
            ) from None
        return coeffs.predict(cp_degree, uncached_tokens, cached_tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "block_size": self.block_size,
            "degrees": {str(c): self.coeffs[c].to_json() for c in self.degrees},
            "mape": {str(c): v for c, v in sorted(self.mape.items())},
            "capacity": {str(c): v for c, v in sorted(self.capacity.items())},
            "provenance": self.provenance,
            **({"host_link": self.host_link} if self.host_link else {}),
            **({} if self.attention.full else {"attention": self.attention.to_json()}),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], source: str = "profile") -> Profile:
        try:
            degrees = raw["degrees"]
            mix = AttentionMix.from_json(raw["attention"], source) if "attention" in raw else FULL
            coeffs = {
                _degree(k, source): DegreeCoeffs(
                    **{n: float(v[n]) for n in COEFF_NAMES}, attention=mix
                )
                for k, v in degrees.items()
            }
            return cls(
                model=str(raw["model"]),
                hardware=str(raw["hardware"]),
                block_size=int(raw["block_size"]),
                coeffs=coeffs,
                mape={_degree(k, source): float(v) for k, v in raw.get("mape", {}).items()},
                capacity={_degree(k, source): dict(v) for k, v in raw.get("capacity", {}).items()},
                provenance=dict(raw.get("provenance", {})),
                host_link=_host_link(raw.get("host_link", {}), source),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ProfileError(
                f"{source}: malformed profile ({type(exc).__name__}: {exc})"
            ) from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, spec: str | Path) -> Profile:
        """A profile file, or the name of a shipped profile (``shipped_profiles``)."""
        path = resolve_profile(spec)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"{spec}: {exc}") from exc
        return cls.from_json(raw, source=str(spec))


HOST_LINK_FIELDS = ("kv_bytes_per_token", "d2h_bytes_s", "h2d_bytes_s")


def _host_link(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The profile's ``host_link``: each of ``HOST_LINK_FIELDS`` positive if given."""
    link = dict(raw)
    for name in HOST_LINK_FIELDS:
        if name in link and not (isinstance(link[name], (int, float)) and link[name] > 0):
            raise ProfileError(f"{source}: host_link.{name} must be a positive number")
    return link


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with the package (``vertumnus/data/profiles``)."""
    folder = resources.files("vertumnus") / "data" / "profiles"
    return sorted(
        f.name.removesuffix(".json") for f in folder.iterdir() if f.name.endswith(".json")
    )


def resolve_profile(spec: str | Path) -> Traversable:
    """A path to an existing file is that file; a bare name (``tiny-cpu``, with or
    without ``.json``) is a shipped profile, found with ``importlib.resources`` so that
    an installed package finds it from any folder."""
    path = Path(spec)
    if path.is_file():
        return path
    names = shipped_profiles()
    name = str(spec).removesuffix(".json")
    if path.parent == Path(".") and name in names:
        return resources.files("vertumnus") / "data" / "profiles" / f"{name}.json"
    hint = ""
    if path.stem in names:
        hint = f" (the shipped profile of that name is {path.stem!r})"
    raise ProfileError(f"{spec}: no such profile file{hint}; shipped profiles: {', '.join(names)}")


def _degree(key: object, source: str) -> int:
    try:
        degree = int(str(key))
    except ValueError:
        raise ProfileError(f"{source}: degree {key!r} is not an integer") from None
    if degree < 1:
        raise ProfileError(f"{source}: degree {degree} must be >= 1")
    return degree


def read_samples_csv(path: str | Path) -> list[Sample]:
    """Rows ``degree,uncached_tokens,cached_tokens,seconds``; errors name the line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
        raise ProfileError(
            f"{path}:1: expected the header {','.join(CSV_HEADER)}, got {','.join(header or [])!r}"
        )
    samples = []
    for line, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(CSV_HEADER):
            raise ProfileError(f"{path}:{line}: expected {len(CSV_HEADER)} fields, got {len(row)}")
        try:
            degree, r, p = (int(cell) for cell in row[:3])
            seconds = float(row[3])
        except ValueError:
            raise ProfileError(
                f"{path}:{line}: degree and token counts must be integers "
                f"and seconds a number, got {','.join(row)!r}"
            ) from None
        if degree < 1 or r < 1 or p < 0:
            raise ProfileError(
                f"{path}:{line}: need degree >= 1, uncached_tokens >= 1 and "
                f"cached_tokens >= 0, got {','.join(row)!r}"
            )
        if not (math.isfinite(seconds) and seconds > 0):
            raise ProfileError(f"{path}:{line}: seconds must be a positive number, got {row[3]!r}")
        samples.append(Sample(degree, r, p, seconds))
    if not samples:
        raise ProfileError(f"{path}: no samples")
    return samples


def fit_profile(
    samples: list[Sample],
    model: str,
    hardware: str,
    block_size: int,
    provenance: dict[str, Any] | None = None,
    attention: AttentionMix = FULL,
) -> Profile:
    """One fit per degree present in ``samples`` (W of the model's ``attention``
    mix), with its in-sample MAPE."""
    by_degree: dict[int, list[Sample]] = {}
    for s in samples:
        by_degree.setdefault(s.cp_degree, []).append(s)
    coeffs = {c: fit_degree(ss, attention) for c, ss in sorted(by_degree.items())}
    errors = {c: mape(coeffs[c], by_degree[c]) for c in coeffs}
    return Profile(
        model=model,
        hardware=hardware,
        block_size=block_size,
        coeffs=coeffs,
        mape=errors,
        provenance=dict(provenance or {}),
    )
