"""PNG figures: a reader sees the verdict at a glance (title colour, shaded band, marked steps)."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

COLOURS = {"pass": "#1a7f37", "warn": "#b35900", "fail": "#c62828", "skipped": "#666666"}
MAX_POINTS = 4000


def _thin(df: pd.DataFrame) -> pd.DataFrame:
    """Keep at most MAX_POINTS rows for drawing; out-of-band rows are always kept so spikes stay visible."""
    if len(df) <= MAX_POINTS:
        return df
    stride = int(np.ceil(len(df) / MAX_POINTS))
    keep = np.zeros(len(df), dtype=bool)
    keep[::stride] = True
    if "outside" in df:
        out_idx = np.flatnonzero(df["outside"].to_numpy())
        keep[out_idx[: MAX_POINTS]] = True
    keep[-1] = True
    return df[keep]


def _save(fig: plt.Figure, path: Path) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    path.write_bytes(data)
    return data


def loss_curves(table: pd.DataFrame, labels: dict[str, str], verdict: str, path: Path,
                title: str = "Loss", prefix: str = "") -> bytes | None:
    cols = {c[len(prefix):]: c for c in table.columns if c.startswith(prefix)} if prefix else \
        {c: c for c in table.columns}
    if "baseline" not in cols or "candidate" not in cols:
        return None
    df = _thin(table[[cols[k] for k in cols]].dropna(how="all").rename(columns={v: k for k, v in cols.items()}))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for c in sorted(k for k in df.columns if k.startswith("repeat")):
        ax.plot(df.index, df[c], color="#9e9e9e", lw=0.8, alpha=0.8, label=labels.get(c, c))
    ax.plot(df.index, df["baseline"], color="#1f4e9e", lw=1.2, label=labels.get("baseline", "baseline"))
    ax.plot(df.index, df["candidate"], color="#e07b00", lw=1.0, ls="--",
            label=labels.get("candidate", "candidate"))
    ax.set_xlabel("step")
    ax.set_ylabel(title.lower())
    ax.set_title(f"{title}: baseline vs candidate  [{verdict.upper()}]", color=COLOURS.get(verdict, "k"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def delta_band(table: pd.DataFrame, verdict: str, path: Path, divergence_step: int | None,
               nonfinite_step: int | None, title: str = "Loss delta", prefix: str = "") -> bytes | None:
    need = [prefix + c for c in ("delta", "band", "outside")]
    if any(c not in table.columns for c in need):
        return None
    df = table[[c for c in table.columns if c.startswith(prefix)]].dropna(subset=[prefix + "delta"])
    df = df.rename(columns=lambda c: c[len(prefix):])
    df = _thin(df)
    if df.empty:
        return None
    x = df.index.to_numpy()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.fill_between(x, -df["band"], df["band"], color="#90caf9", alpha=0.5, step="mid",
                    label="benchmark error band")
    for c in sorted(k for k in df.columns if k.startswith("repeat")):
        ax.plot(x, df[c] - df["baseline"], color="#9e9e9e", lw=0.6, alpha=0.8, label=f"{c} - baseline")
    ax.plot(x, df["delta"], color="#e07b00", lw=0.9, label="candidate - baseline")
    out = df[df["outside"].astype(bool)]
    if len(out):
        ax.scatter(out.index, out["delta"].clip(-1e30, 1e30), s=6, color=COLOURS["fail"], zorder=3,
                   label=f"outside band ({len(out)} shown)")
    ax.axhline(0, color="k", lw=0.6)
    if divergence_step is not None:
        ax.axvline(divergence_step, color=COLOURS["fail"], ls="--", lw=1.2)
        ax.annotate(f"divergence from step {divergence_step}", (divergence_step, ax.get_ylim()[1]),
                    color=COLOURS["fail"], fontsize=8, va="top", ha="left", xytext=(4, -4),
                    textcoords="offset points")
    if nonfinite_step is not None:
        ax.axvline(nonfinite_step, color="#6a1b9a", ls=":", lw=1.5)
        ax.annotate(f"NaN/Inf at step {nonfinite_step}", (nonfinite_step, ax.get_ylim()[0]),
                    color="#6a1b9a", fontsize=8, va="bottom", xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("step")
    ax.set_ylabel("candidate - baseline")
    ax.set_title(f"{title} against the benchmark band  [{verdict.upper()}]", color=COLOURS.get(verdict, "k"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def _bar_colours(values: list[float], pass_tol: float, warn_tol: float | None = None) -> list[str]:
    warn_tol = warn_tol if warn_tol is not None else pass_tol * 10
    return [COLOURS["fail"] if not np.isfinite(v) or v > warn_tol else COLOURS["warn"] if v > pass_tol
            else COLOURS["pass"] for v in values]


def local_norm_chart(parameters: list[dict], rtol: float, verdict: str, path: Path) -> bytes | None:
    """Relative difference of every parameter's step-1 gradient norm, names on the axis, grouped by layer."""
    if not parameters:
        return None
    def order(p: dict) -> tuple:
        layer = p.get("layer")
        return (-1 if layer is None and p.get("kind") == "embedding" else 10**6 if layer is None else layer,
                p["name"])
    rows = sorted(parameters, key=order)
    vals = [float(p["rel_diff"]) if p.get("rel_diff") is not None else float("inf") for p in rows]
    shown = [max(v, 1e-12) if np.isfinite(v) else 1e3 for v in vals]
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.22 * len(rows) + 1)))
    y = np.arange(len(rows))
    ax.barh(y, shown, color=_bar_colours(vals, rtol))
    ax.axvline(rtol, color="grey", ls="--", lw=0.8, label=f"tolerance {rtol:g}")
    ax.set_yticks(y)
    ax.set_yticklabels([p["name"] for p in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("relative difference of the gradient norm (candidate vs baseline)")
    layers = [p.get("layer") for p in rows]
    for i in range(1, len(rows)):
        if layers[i] != layers[i - 1]:
            ax.axhline(i - 0.5, color="#bbbbbb", lw=0.6)
    ax.set_title(f"Step-1 local norms per parameter, grouped by layer  [{verdict.upper()}]",
                 color=COLOURS.get(verdict, "k"))
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def layer_profile(rows: list[dict], verdict: str, path: Path) -> bytes | None:
    """Per-module error at one step in execution order, forward then backward: where the runs part."""
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    fig.suptitle(f"Layer profile: relative error per module (log scale), forward then backward  "
                 f"[{verdict.upper()}]", fontsize=10, color=COLOURS.get(verdict, "k"))
    for ax, direction in zip(axes, ("forward", "backward"), strict=True):
        sel = [r for r in rows if r.get("direction") == direction]
        if not sel:
            ax.set_visible(False)
            continue
        vals = [max(float(r["value"]), 1e-12) if np.isfinite(float(r["value"])) else 1e3 for r in sel]
        colours = [COLOURS.get(r.get("verdict"), "#666666") for r in sel]
        ax.bar(range(len(sel)), vals, color=colours)
        ax.axhline(float(sel[0]["threshold"]), color="grey", ls="--", lw=0.8, label="tolerance")
        ax.set_yscale("log")
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([str(r["module"]).replace("decoder.layers.", "L").replace("self_attention", "attn")
                            for r in sel], rotation=70, fontsize=7)
        ax.set_title(f"{direction} ({sel[0].get('metric', '')})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def lr0_pair(rows: list[dict]) -> bytes | None:
    """lr = 0 pair: both losses per step (weights never move) and their delta."""
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    fig.suptitle("lr = 0 pair: loss per step (weights never move) and its delta", fontsize=10)
    ax1.plot(steps, [r["loss_baseline"] for r in rows], "o-", label="baseline")
    ax1.plot(steps, [r["loss_candidate"] for r in rows], "x--", label="candidate")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (lr = 0)")
    ax1.legend(fontsize=8)
    ax2.plot(steps, [r["loss_candidate"] - r["loss_baseline"] for r in rows], ".-")
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss delta (candidate - baseline)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
