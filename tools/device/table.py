"""The check's verdicts: every figure of the report with its target and PASS, FAIL,
SKIP or INFO (a figure recorded without a target), as rows for the JSON and as the
printed table.

Targets: exactness within each case's tolerance; the engine's MFU at the longest
length (32K on the device) >= 50 %; the engine no slower than transformers at every
length; the measured profile written and loadable. A step that failed is a FAIL row
with its error; the CP step is a SKIP row with its reason.
"""

from __future__ import annotations

from typing import Any

MFU_TARGET = 0.5

Row = dict[str, str]


def _row(name: str, figure: str, target: str, result: str) -> Row:
    return {"name": name, "figure": figure, "target": target, "result": result}


def _ok(flag: bool) -> str:
    return "PASS" if flag else "FAIL"


def _failed(name: str, step: dict[str, Any]) -> list[Row]:
    if step.get("status") == "ok":
        return []
    result = "SKIP" if step.get("status") == "skipped" else "FAIL"
    reason = str(step.get("reason") or step.get("error") or step.get("status"))
    return [_row(name, reason, "runs", result)]


def exactness_rows(step: dict[str, Any]) -> list[Row]:
    rows = _failed("exactness", step)
    for c in step.get("cases", []):
        name = f"exact {c['model']} {c['dtype']} P={c['prefix_len']}"
        if c["dtype"] == "float32":
            figure, target = f"max|diff| {c['max_abs_diff']:.2e}", f"<= {c['tolerance']:.0e}"
        else:
            short = {"typical_row_err": "row", "rms_err": "rms", "max_err": "max"}
            figure = ", ".join(
                f"{s} {c[k]:.3g} (tf {c[k + '_transformers']:.3g})" for k, s in short.items()
            )
            figure += f"; vs tf-bf16 {c['max_abs_diff_vs_transformers_bf16']:.3g}"
            target = ", ".join(
                f"{short[k]} <= {c[k + '_tolerance']:.3g}" for k in c["held_to_rule"]
            )
        rows.append(_row(name, figure, target, _ok(c["passed"])))
    return rows


def _mfu(value: float | None) -> str:
    return "MFU n/a" if value is None else f"MFU {100 * value:.1f} %"


def speed_rows(step: dict[str, Any]) -> list[Row]:
    rows = _failed("prefill", step)
    if step.get("status") != "ok":
        return rows
    model, memory, peak = step["model"], step["memory"], step["peak"]
    n = model["params"]
    size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    figure = f"{model['layers']} layers, {size} params bf16"
    rows.append(_row("model", figure + f", built in {model['build_s']:.1f} s", "-", "INFO"))
    if memory["reduced"]:
        rows.append(_row("layers reduced", memory["reason"], "48 layers", "FAIL"))
    longest = max(p["tokens"] for p in step["points"] if not p["prefix"])
    for p in step["points"]:
        r, pre, engine = p["tokens"], p["prefix"], p["engine"]
        label = f"R={r}" + (f" P={pre}" if pre else "")
        if engine.get("status") != "ok":
            rows.append(
                _row(
                    f"engine {label}",
                    str(engine.get("error") or engine["status"]),
                    "runs",
                    "SKIP" if "budget" in engine["status"] else "FAIL",
                )
            )
            continue
        figure = (
            f"{engine['median_s']:.4g} s, {engine['tokens_s']:.4g} tok/s, {_mfu(engine['mfu'])}"
        )
        if r == longest and not pre:
            if engine["mfu"] is None or peak.get("nominal"):
                result = "SKIP"
                figure += f" (peak {peak['source']})"
            else:
                result = _ok(engine["mfu"] >= MFU_TARGET)
            rows.append(_row(f"engine {label}", figure, f"MFU >= {100 * MFU_TARGET:.0f} %", result))
        else:
            rows.append(_row(f"engine {label}", figure, "-", "INFO"))
        if not pre:
            rows.append(_vs_transformers(label, engine, p["transformers"]))
        ratio = p.get("measured_over_profile")
        figure = f"E_1 {p['profile_e1_s']:.4g} s, measured/predicted {ratio:.3g}"
        note = "-" if step["profile_comparable"] else "- (not the profile's model)"
        rows.append(_row(f"vs profile {label}", figure, note, "INFO"))
    return rows


def _vs_transformers(label: str, engine: dict[str, Any], hf: dict[str, Any]) -> Row:
    target = "engine <= transformers"
    if "median_s" not in hf:
        why = hf.get("error") or hf.get("note") or hf["status"]
        if hf["status"] == "too_slow":
            why = f"transformers too slow: warm-up {hf['warmup_s']:.1f} s"
        return _row(f"vs transformers {label}", str(why), target, "SKIP")
    figure = (
        f"tf {hf['median_s']:.4g} s ({_mfu(hf['mfu'])}): engine "
        f"{hf['median_s'] / engine['median_s']:.2f}x"
    )
    return _row(
        f"vs transformers {label}", figure, target, _ok(engine["median_s"] <= hf["median_s"])
    )


def profile_rows(step: dict[str, Any]) -> list[Row]:
    rows = _failed("measured profile", step)
    if step.get("status") == "ok":
        c = step["coefficients"]
        figure = (
            f"d {c['d']:.3g} c {c['c']:.3g} b {c['b']:.3g} alpha {c['alpha']:.3g}, "
            f"MAPE {100 * step['mape']:.1f} % -> {step['path']}"
        )
        rows.append(_row("measured profile", figure, "written, loads", "PASS"))
    return rows


def host_rows(step: dict[str, Any]) -> list[Row]:
    rows = _failed("host link", step)
    if step.get("status") == "ok":
        tier, handoff = step["tier"], step["handoff"]
        rows += [
            _row("host tier D2H", f"{tier['d2h_bytes_s'] / 1e9:.2f} GB/s", "-", "INFO"),
            _row("host tier H2D", f"{tier['h2d_bytes_s'] / 1e9:.2f} GB/s", "-", "INFO"),
            _row("hand-off D2H", f"{handoff['d2h_bytes_s'] / 1e9:.2f} GB/s", "-", "INFO"),
        ]
    return rows


def rank_rows(step: dict[str, Any]) -> list[Row]:
    rows = _failed("rank process", step)
    for r in step.get("runs", []) if step.get("status") == "ok" else []:
        name = f"rank process P={r['cached_tokens']}"
        figure = (
            f"max|diff| {r['max_abs_diff']:.2e}; rank {r['rank_compute_s']:.4f} s, "
            f"client {r['client_s']:.4f} s"
        )
        rows.append(_row(name, figure, f"<= {step['tolerance']:.0e}", _ok(r["passed"])))
    return rows


def rows(report: dict[str, Any]) -> list[Row]:
    steps = report["steps"]
    out = exactness_rows(steps.get("exactness", {"status": "missing"}))
    out += speed_rows(steps.get("prefill", {"status": "missing"}))
    out += profile_rows(steps.get("profile", {"status": "missing"}))
    out += host_rows(steps.get("host_link", {"status": "missing"}))
    out += rank_rows(steps.get("rank", {"status": "missing"}))
    out += _failed("CP across ranks", steps.get("cp", {"status": "missing"}))
    return out


def render(table: list[Row]) -> str:
    heads = ("check", "figure", "target", "result")
    keys = ("name", "figure", "target", "result")
    widths = [max(len(h), *(len(r[k]) for r in table)) for h, k in zip(heads, keys, strict=True)]
    widths[1] = min(widths[1], 90)
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in table:
        lines.append("  ".join(r[k].ljust(w) for k, w in zip(keys, widths, strict=True)))
    return "\n".join(lines)
