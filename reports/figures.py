"""PNG figures: a reader sees the verdict at a glance (title colour, shaded band, marked steps)."""

from __future__ import annotations

import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.legend import Legend
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

COLOURS = {"pass": "#1a7f37", "warn": "#b35900", "fail": "#c62828", "skipped": "#666666"}
DPI = 100
#: the curve figure's widest axes: margins are measured from its texts (:func:`_fit_grid`), never narrower than
#: these (not bbox_inches="tight", which draws every figure twice to measure it)
MARGINS = {"left": 0.08, "right": 0.98, "bottom": 0.14, "top": 0.9}
CURVE_SIZE = (9, 3.6)   # inches: the curve figure every loss / delta plot reuses
#: pixel columns of that figure's axes at most (810): a long curve is drawn from each column's min and max
#: (envelope)
COLUMNS = round(CURVE_SIZE[0] * DPI * (MARGINS["right"] - MARGINS["left"]))
PAD = 4                 # pixels between a figure's outermost text and its edge


def _figure(figsize: tuple[float, float], ncols: int = 1, sharey: bool = False) -> tuple[Figure, Any]:
    """A figure on the Agg canvas, without pyplot (no figure manager, nothing to close)."""
    fig = Figure(figsize=figsize, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, sharey=sharey)
    return fig, axes


_LOCAL = threading.local()


def _curve_axes() -> tuple[Figure, Any]:
    """The one 9 x 3.6 figure every curve plot reuses (per thread), emptied of the last plot's artists: its
    axes and tick objects are kept, and building those is most of a small figure's cost."""
    got = getattr(_LOCAL, "curves", None)
    if got is None:
        fig, ax = _figure(CURVE_SIZE)
        fig.subplots_adjust(**MARGINS)
        _LOCAL.curves = got = (fig, ax)
        return got
    fig, ax = got
    for artist in [*ax.lines, *ax.collections, *ax.texts, *ax.patches, *fig.legends]:
        artist.remove()
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    ax.relim()
    ax.set_autoscale_on(True)
    ax.set_title("")
    return got


def warm() -> None:
    """Build the reused curve figure now: a forked child (reports.render) then inherits it instead of
    building its own for every report."""
    _curve_axes()


#: the figure legend's spacing, in font sizes (handletextpad and borderpad are matplotlib's defaults)
LEGEND = {"handlelength": 1.8, "handletextpad": 0.8, "columnspacing": 1.5, "borderpad": 0.4}


def _legend_below(fig: Figure, handles: list, fontsize: float = 8) -> Legend | None:
    """One legend for the whole figure, centred under everything (off the data), in as many columns as
    the figure's width holds (one row when it fits: its width is reckoned from the labels' widths, as the
    legend lays them out, so it is made once); handles with the same label are named once."""
    seen: dict[str, Any] = {}
    for h in handles:
        label = h.get_label()
        if label and not label.startswith("_"):
            seen.setdefault(label, h)
    if not seen:
        return None
    em = fontsize * DPI / 72
    widths = np.array([_text_px(fig, label, fontsize)[0] for label in seen])
    entry = (LEGEND["handlelength"] + LEGEND["handletextpad"]) * em

    def width(ncols: int) -> float:      # matplotlib splits the entries into ncols columns as array_split does
        cols = [c for c in np.array_split(widths, ncols) if len(c)]
        return sum(c.max() + entry for c in cols) + ((len(cols) - 1) * LEGEND["columnspacing"]
                                                     + 2 * LEGEND["borderpad"]) * em

    n = ncols = len(seen)
    while ncols > 1 and width(ncols) > 0.97 * (fig.bbox.width - 2 * PAD):
        ncols = -(-n // (-(-n // ncols) + 1))      # one row more
    # _fit_grid makes room for it under the axes
    return fig.legend(list(seen.values()), list(seen), loc="lower center", bbox_to_anchor=(0.5, 0), ncols=ncols,
                      fontsize=fontsize, frameon=False, borderaxespad=0.2, **LEGEND)


#: a tick's length plus its label's pad (matplotlib's defaults: 3.5 pt each), in pixels
TICK_PX = 7 * DPI / 72


def _text_px(fig: Figure, text: str, points: float | FontProperties) -> tuple[float, float]:
    """Width and height in pixels of one line of ``text`` (mathtext when in $...$) at ``points`` (or in a
    font): a tick label measured without making its tick."""
    font = points if isinstance(points, FontProperties) else FontProperties(size=points)
    math = len(text) > 1 and text[0] == text[-1] == "$"
    w, h, _ = fig.canvas.get_renderer().get_text_width_height_descent(text, font, ismath=math)
    return w, h


def _xaxis_px(fig: Figure, ax: Any) -> tuple[float, float]:
    """How deep an axes' x decorations reach under it (tick, tick label, axis label) and how far its last tick
    label reaches past its right edge, in pixels, from the major tick labels in view measured one by one:
    Axis.get_tightbbox would lay out every minor tick of a log axis as well."""
    axis = ax.xaxis
    lo, hi = sorted(axis.get_view_interval())
    locs = [v for v in axis.get_majorticklocs() if lo <= v <= hi]
    font = axis.get_major_ticks(1)[0].label1.get_fontproperties()
    sizes = [_text_px(fig, t, font) for t in axis.get_major_formatter().format_ticks(locs) if t] if locs else []
    depth = TICK_PX + max((h for _, h in sizes), default=0.0)
    if axis.label.get_text():
        depth += axis.labelpad * DPI / 72 + axis.label.get_window_extent(fig.canvas.get_renderer()).height
    over = 0.0
    if sizes:
        right = max(range(len(locs)), key=lambda i: locs[i])
        over = ax.transData.transform((locs[right], 0))[0] + sizes[right][0] / 2 - ax.bbox.x1
    return depth, over


def _top(ax: Any, renderer: Any) -> float:
    """How far an axes' titles and its y offset text ("1e-5", placed 3 pt above the axes when drawn; a title
    in its way is raised above it) reach above the axes, in pixels."""
    tops = [t.get_window_extent(renderer).y1 for t in (ax.title, ax._left_title, ax._right_title)
            if t.get_visible() and t.get_text()]
    top = max(max(tops) - ax.bbox.y1, 0.0) if tops else 0.0
    off = ax.yaxis.offsetText
    if off.get_visible() and off.get_text():
        top += off.get_window_extent(renderer).height + 3 * DPI / 72
    return top


def _fit_grid(fig: Figure, grid: Any, legend: Legend | None, *, names: dict[str, float] | None = None) -> None:
    """Margins and gaps of a grid of equal axes from what their texts measure (tick labels, axis labels,
    titles, the suptitle, the legend under everything), so every text lies inside the canvas and off its
    neighbour: the texts are laid out once here (matplotlib keeps each layout for the draw) instead of the
    figure being drawn twice (bbox_inches="tight") or measured twice per draw (constrained layout).
    ``names``: {"x" or "y": pixels} for an axis whose tick labels are names the caller measured itself (a
    long list of labels is the costly part to lay out); "left": the least left margin (rotated names). The
    curve figure never gets axes wider than ``COLUMNS``, the envelope's columns."""
    renderer = fig.canvas.get_renderer()
    names = names or {}
    grid = np.atleast_2d(np.asarray(grid, dtype=object))
    nrows, ncols = grid.shape
    shown = [(i, k, ax) for (i, k), ax in np.ndenumerate(grid) if ax.get_visible()]
    dec = np.zeros((nrows, ncols, 4))                      # per axes: left, right, bottom, top, in pixels
    for i, k, ax in shown:                                 # heights first: the y ticks depend on them
        if "x" in names:
            dec[i, k, 2] = names["x"]
        elif ax.xaxis.get_visible():
            dec[i, k, 2], dec[i, k, 1] = _xaxis_px(fig, ax)
        dec[i, k, 3] = _top(ax, renderer)
    w, h = fig.bbox.width, fig.bbox.height
    sup = h - fig._suptitle.get_window_extent(renderer).y0 + PAD if fig._suptitle is not None else 0.0
    below = legend.get_window_extent(renderer).height + PAD if legend is not None else 0.0
    dec = np.maximum(dec, 0.0)
    bottom = PAD + below + dec[-1, :, 2].max()

    def heights() -> None:
        top = PAD + sup + dec[0, :, 3].max()
        hgap = max((dec[i, :, 2].max() + dec[i + 1, :, 3].max() for i in range(nrows - 1)), default=0.0) + 2 * PAD
        ah = (h - top - bottom - (nrows - 1) * hgap) / nrows
        fig.subplots_adjust(bottom=bottom / h, top=1 - top / h, hspace=hgap / max(ah, 1.0))

    heights()
    for i, k, ax in shown:
        if "y" in names:
            dec[i, k, 0] = names["y"]
        else:
            yb = ax.yaxis.get_tightbbox(renderer)
            dec[i, k, 0] = max(ax.bbox.x0 - yb.x0, 0.0) if yb is not None else 0.0
    # the y ticks, now computed, may have put an offset or exponent ("1e-5") above an axes: room for it too
    tops = np.array([[_top(ax, renderer) if ax.get_visible() else 0.0 for ax in row] for row in grid])
    if (tops > dec[:, :, 3] + 0.5).any():
        dec[:, :, 3] = np.maximum(dec[:, :, 3], tops)
        heights()
    left = PAD + max(dec[:, 0, 0].max(), names.get("left", 0.0))
    right = PAD + dec[:, -1, 1].max()
    wgap = max((dec[:, k, 1].max() + dec[:, k + 1, 0].max() for k in range(ncols - 1)), default=0.0) + 2 * PAD
    if nrows == ncols == 1 and fig.get_size_inches()[0] == CURVE_SIZE[0]:
        left, right = max(left, MARGINS["left"] * w), max(right, (1 - MARGINS["right"]) * w)
    aw = (w - left - right - (ncols - 1) * wgap) / ncols
    fig.subplots_adjust(left=left / w, right=1 - right / w, wspace=wgap / max(aw, 1.0))


def envelope(x: np.ndarray, y: np.ndarray, columns: int = COLUMNS) -> tuple[np.ndarray, np.ndarray]:
    """The points of a long series that draw like all of it: matplotlib's time goes with the points it is
    given, and a 100k-step run on an axes ``columns`` pixels wide has ~100 points a pixel. The x range is cut
    into ``columns`` equal columns (narrower than a pixel, as the axes' margins widen the view) and each
    keeps its first minimum and first maximum in step order, so a one-step spike is still drawn; the first
    and last points are kept. NaN values are skipped; a column of NaN only keeps one (the gap the full
    curve shows). A series of at most ``2 * columns`` points is returned as given. x out of order is
    cut by position instead."""
    n = len(y)
    if n <= 2 * columns:
        return x, y
    ys = np.asarray(y, dtype=np.float64)
    pos = np.asarray(x, dtype=np.float64)
    if not (pos[-1] > pos[0] and np.all(pos[1:] >= pos[:-1])):   # also false for NaN steps
        pos = np.arange(n, dtype=np.float64)
    edges = pos[0] + (pos[-1] - pos[0]) * (np.arange(columns) / columns)
    starts = np.unique(np.searchsorted(pos, edges))                # where each non-empty column begins
    counts = np.diff(starts, append=n)
    keep = [np.array([0, n - 1])]
    for reduce in (np.fmin, np.fmax):                                # fmin/fmax skip NaN
        ext = reduce.reduceat(ys, starts)
        hits = np.flatnonzero(ys == np.repeat(ext, counts))
        first = hits[np.minimum(np.searchsorted(hits, starts), len(hits) - 1)] if len(hits) else starts
        keep.append(np.where(np.isnan(ext), starts, first))          # an all-NaN column: its first NaN
    idx = np.unique(np.concatenate(keep))
    return np.asarray(x)[idx], ys[idx]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(rgba: np.ndarray, dpi: float = DPI) -> bytes:
    """A PNG of an (h, w, 4) uint8 image: RGB when every pixel is opaque (a figure's background is), each row
    filtered as the difference from the row above, deflated at level 1. 3x faster than Pillow's writer at
    level 1 (which keeps the alpha channel and tries filters per row) and smaller: a curve figure is mostly
    rows equal to the one above; zlib lets go of the GIL while it compresses."""
    h, w, _ = rgba.shape
    opaque = bool((rgba[..., 3] == 255).all())
    rows = (rgba[..., :3] if opaque else rgba).reshape(h, -1)
    data = np.empty((h, rows.shape[1] + 1), dtype=np.uint8)
    data[:, 0] = 2                                               # filter type 2 (Up) on every row
    data[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=data[1:, 1:])           # uint8: wraps modulo 256, as PNG defines
    ppm = round(dpi / 0.0254)
    return (b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2 if opaque else 6, 0, 0, 0))
            + _chunk(b"pHYs", struct.pack(">IIB", ppm, ppm, 1))
            + _chunk(b"IDAT", zlib.compress(data.tobytes(), 1)) + _chunk(b"IEND", b""))


def _save(fig: Figure, path: Path | None) -> bytes:
    """Draw ``fig`` at its own DPI (what savefig did, without its per-call set-up) and encode it with
    :func:`png`."""
    fig.canvas.draw()
    data = png(np.asarray(fig.canvas.buffer_rgba()), fig.dpi)
    if path is not None:
        path.write_bytes(data)
    return data


def loss_curves(table: pd.DataFrame, labels: dict[str, str], verdict: str, path: Path,
                title: str = "Loss", prefix: str = "") -> bytes | None:
    cols = {c[len(prefix):]: c for c in table.columns if c.startswith(prefix)} if prefix else \
        {c: c for c in table.columns}
    if "baseline" not in cols or "candidate" not in cols:
        return None
    x = table.index.to_numpy()
    rows = np.zeros(len(x), dtype=bool)                  # steps with any value (no 100k x columns copy)
    data = {}
    for k, c in cols.items():
        v = table[c].to_numpy(dtype=np.float64)
        rows |= ~np.isnan(v)
        if k in ("baseline", "candidate") or k.startswith("repeat"):
            data[k] = v
    if not rows.all():
        x = x[rows]
        data = {k: v[rows] for k, v in data.items()}
    fig, ax = _curve_axes()
    for c in sorted(k for k in data if k.startswith("repeat")):
        ax.plot(*envelope(x, data[c]), color="#9e9e9e", lw=0.8, alpha=0.8, label=labels.get(c, c))
    ax.plot(*envelope(x, data["baseline"]), color="#1f4e9e", lw=1.2, label=labels.get("baseline", "baseline"))
    ax.plot(*envelope(x, data["candidate"]), color="#e07b00", lw=1.0, ls="--",
            label=labels.get("candidate", "candidate"))
    ax.set_xlabel("step")
    ax.set_ylabel(title.lower())
    ax.set_title(f"{title}: baseline vs candidate  [{verdict.upper()}]", color=COLOURS.get(verdict, "k"),
                 y=1)   # placed, not auto-placed: that measures the y axis once more at every draw
    ax.grid(alpha=0.3)
    _fit_grid(fig, ax, _legend_below(fig, ax.get_legend_handles_labels()[0]))
    return _save(fig, path)


def delta_band(table: pd.DataFrame, verdict: str, path: Path, divergence_step: int | None,
               nonfinite_step: int | None, title: str = "Loss delta", prefix: str = "") -> bytes | None:
    need = [prefix + c for c in ("delta", "band", "outside")]
    if any(c not in table.columns for c in need):
        return None
    delta = table[prefix + "delta"].to_numpy(dtype=np.float64)
    rows = ~np.isnan(delta)
    if not rows.any():
        return None
    x = table.index.to_numpy()[rows]
    col = {k: table[prefix + k].to_numpy(dtype=np.float64)[rows]   # only the columns drawn
           for k in (c[len(prefix):] for c in table.columns if c.startswith(prefix))
           if k in ("delta", "band", "outside", "baseline") or k.startswith("repeat")}
    delta = col["delta"]
    fig, ax = _curve_axes()
    bx, band = envelope(x, col["band"])
    ax.fill_between(bx, -band, band, color="#90caf9", alpha=0.5, step="mid", label="benchmark error band")
    for c in sorted(k for k in col if k.startswith("repeat")):
        ax.plot(*envelope(x, col[c] - col["baseline"]), color="#9e9e9e", lw=0.6, alpha=0.8,
                label=f"{c} - baseline")
    ax.plot(*envelope(x, delta), color="#e07b00", lw=0.9, label="candidate - baseline")
    out = col["outside"].astype(bool)
    n_out = int(out.sum())
    if n_out:
        ox, oy = envelope(x[out], np.clip(delta[out], -1e30, 1e30))
        ax.scatter(ox, oy, s=6, color=COLOURS["fail"], zorder=3,
                   label=f"outside band ({n_out} steps)" if len(ox) == n_out else
                   f"outside band ({n_out} steps, extremes of {len(ox)} shown)")
    ax.axhline(0, color="k", lw=0.6)
    # the marked steps are named in the legend (a label on the axes would sit on the curve)
    if divergence_step is not None:
        ax.axvline(divergence_step, color=COLOURS["fail"], ls="--", lw=1.2,
                   label=f"divergence from step {divergence_step}")
    if nonfinite_step is not None:
        ax.axvline(nonfinite_step, color="#6a1b9a", ls=":", lw=1.5, label=f"first NaN/Inf at step {nonfinite_step}")
    ax.set_xlabel("step")
    ax.set_ylabel("candidate - baseline")
    ax.set_title(f"{title} against the benchmark band  [{verdict.upper()}]", color=COLOURS.get(verdict, "k"), y=1)
    ax.grid(alpha=0.3)
    _fit_grid(fig, ax, _legend_below(fig, ax.get_legend_handles_labels()[0]))
    return _save(fig, path)


def _bar_colours(values: list[float], pass_tol: float, warn_tol: float | None = None) -> list[str]:
    warn_tol = warn_tol if warn_tol is not None else pass_tol * 10
    return [COLOURS["fail"] if not np.isfinite(v) or v > warn_tol else COLOURS["warn"] if v > pass_tol
            else COLOURS["pass"] for v in values]


#: At most this many parameters in the local-norm chart: the largest differences, kept in layer order (a
#: 48-layer MoE model has ~600 parameters: a bar each would make a 130-inch figure no one can read).
MAX_NORM_BARS = 60
#: At most this many module names under a layer-profile panel (one per bar up to it, then every k-th bar):
#: more do not fit at 7 pt, and each rotated label costs drawing time (600 bars a panel took 16 s).
MAX_BAR_LABELS = 40


def _text_inches(chars: int, points: float = 7) -> float:
    """About how wide ``chars`` characters of DejaVu Sans are: margins are set from it instead of by
    tight_layout, which draws the figure once more to measure it."""
    return chars * 0.55 * points / 72


def _norm_diff(p: dict) -> float:
    """A parameter's relative norm difference; missing or NaN counts as the largest."""
    v = float(p["rel_diff"]) if p.get("rel_diff") is not None else float("inf")
    return v if not np.isnan(v) else float("inf")


def named_bars(n: int) -> list[int]:
    """Which of ``n`` bars get their name under a layer-profile panel: all up to ``MAX_BAR_LABELS``, else
    one in k, evenly, from the first."""
    return list(range(0, n, -(-n // MAX_BAR_LABELS) if n else 1))


def chart_parameters(parameters: list[dict]) -> list[dict]:
    """The local-norm chart's rows: the ``MAX_NORM_BARS`` largest differences (all when fewer), ordered by
    layer: embedding first, then layer by layer, the rest last, by name within each."""
    def order(p: dict) -> tuple:
        layer = p.get("layer")
        return (-1 if layer is None and p.get("kind") == "embedding" else 10**6 if layer is None else layer,
                p["name"])
    return sorted(sorted(parameters, key=_norm_diff, reverse=True)[:MAX_NORM_BARS], key=order)


def local_norm_chart(parameters: list[dict], rtol: float, verdict: str, path: Path) -> bytes | None:
    """Relative difference of every parameter's step-1 gradient norm, names on the axis, grouped by layer
    (the ``MAX_NORM_BARS`` largest when there are more)."""
    return _parameter_bars(parameters, rtol, None, verdict, path,
                           xlabel="relative difference of the gradient norm (candidate vs baseline)",
                           title="Step-1 local norms")


def weights_chart(rows: list[dict], verdict: str, path: Path) -> bytes | None:
    """Relative L2 difference of each parameter's weights (compare-weights), the ``MAX_NORM_BARS`` largest,
    grouped by layer, coloured by each parameter's verdict; a parameter that could not be compared (missing,
    shape) is drawn as the largest. One tolerance line when every parameter has the same; else (dtypes, or
    bands from a repeat) a tick on each bar at its own."""
    params = [{"name": r["name"], "layer": r.get("layer"), "kind": r.get("kind"), "verdict": r.get("verdict"),
               "tol": r.get("tolerance"),
               "rel_diff": r["rel_l2"] if r.get("rel_l2") is not None else float("inf")} for r in rows]
    tols = {r.get("tolerance") for r in rows if r.get("tolerance") is not None}
    warns = {r.get("warn_tolerance") for r in rows if r.get("warn_tolerance") is not None}
    one = len(tols) == 1
    return _parameter_bars(params, float(next(iter(tols))) if one else None,
                           float(next(iter(warns))) if one and len(warns) == 1 else None, verdict, path,
                           xlabel="relative L2 difference of the weights, ||candidate - baseline|| / ||baseline||",
                           title="Weights", own_verdicts=True)


def _verdict_patches(colours: list[str], labels: dict[str, str]) -> list[Patch]:
    """A legend patch for each verdict colour the bars use, in pass / warn / fail order."""
    used = set(colours)
    return [Patch(color=COLOURS[v], label=labels[v]) for v in ("pass", "warn", "fail", "skipped")
            if COLOURS[v] in used and v in labels]


def _parameter_bars(parameters: list[dict], rtol: float | None, warn_tol: float | None, verdict: str, path: Path, *,
                    xlabel: str, title: str, own_verdicts: bool = False) -> bytes | None:
    """Horizontal bars, one per parameter (log scale), names on the axis. ``own_verdicts``: each parameter's
    ``verdict`` colours its bar and its ``tol`` is ticked on it (tolerances differ per parameter); else the
    bars are coloured against ``rtol`` / ``warn_tol``, drawn as lines. The legend, under the axes, names each
    colour used and each line."""
    if not parameters:
        return None
    shown_of = len(parameters)
    rows = chart_parameters(parameters)
    vals = [_norm_diff(p) for p in rows]
    shown = [max(v, 1e-12) if np.isfinite(v) else 1e3 for v in vals]
    names = [p["name"] for p in rows]
    names_in = _text_inches(max(len(n) for n in names)) + 0.2
    height = max(2.5, 0.22 * len(rows) + 1)
    width = 6.5 + names_in
    fig, ax = _figure((width, height))
    y = np.arange(len(rows))
    colours = [COLOURS.get(p.get("verdict") or "fail", COLOURS["fail"]) for p in rows] if own_verdicts else \
        _bar_colours(vals, rtol if rtol is not None else 0.0, warn_tol)
    ax.barh(y, shown, color=colours)
    missing = " (missing or not finite: drawn at 1e3)" if not all(np.isfinite(vals)) else ""
    fails = warn_tol if warn_tol is not None else 10 * (rtol or 0.0)     # _bar_colours' line
    handles: list[Any] = _verdict_patches(colours, {
        "pass": "pass", "warn": "warn", "fail": "fail" + missing} if own_verdicts else {
        "pass": "within tolerance", "warn": "above tolerance (warn)", "fail": f"above {fails:g} (fail){missing}"})
    if rtol is not None:
        handles.append(ax.axvline(rtol, color="grey", ls="--", lw=0.8, label=f"tolerance {rtol:g}"))
    else:
        ticks = [(i, p["tol"]) for i, p in enumerate(rows) if p.get("tol")]
        if ticks:
            handles.append(ax.scatter([t for _, t in ticks], [i for i, _ in ticks], marker="|", s=120, color="k",
                                      zorder=3, label="each parameter's tolerance"))
    if rtol is not None and warn_tol is not None:
        handles.append(ax.axvline(warn_tol, color=COLOURS["fail"], ls=":", lw=0.8, label=f"fails above {warn_tol:g}"))
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    layers = [p.get("layer") for p in rows]
    for i in range(1, len(rows)):
        if layers[i] != layers[i - 1]:
            ax.axhline(i - 0.5, color="#bbbbbb", lw=0.6)
    what = "per parameter" if shown_of == len(rows) else f"of the {len(rows)} largest of {shown_of} parameters"
    fig.suptitle(f"{title} {what}, grouped by layer  [{verdict.upper()}]", color=COLOURS.get(verdict, "k"))
    ax.grid(axis="x", alpha=0.3)
    _fit_grid(fig, ax, _legend_below(fig, handles, fontsize=7),
              names={"y": TICK_PX + max(_text_px(fig, n, 7)[0] for n in names)})
    return _save(fig, path)


def _rotated_names(fig: Figure, panels: list[list[str]], points: float = 7, degrees: float = 70) -> dict[str, float]:
    """What names rotated under bars (anchored at their right end) take: their depth under the axes
    ({"x": pixels}) and how far the first panel's first name reaches left of its tick ({"left": pixels})."""
    sin, cos = np.sin(np.radians(degrees)), np.cos(np.radians(degrees))
    sizes = [[_text_px(fig, n, points) for n in names] for names in panels]
    depth = max((w * sin + h * cos / 2 for ws in sizes for w, h in ws), default=0.0)
    first = sizes[0][0] if sizes and sizes[0] else (0.0, 0.0)
    return {"x": TICK_PX + depth, "left": first[0] * cos + first[1] * sin / 2}


def layer_profile(rows: list[dict], verdict: str, path: Path) -> bytes | None:
    """Per-module error at one step in execution order, forward then backward: where the runs part."""
    if not rows:
        return None
    panels = []
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r.get("direction") == direction]
        names = [str(r["module"]).replace("decoder.layers.", "L").replace("self_attention", "attn") for r in sel]
        panels.append((direction, sel, named_bars(len(sel)), names))
    longest = max((len(names[i]) for _, _, ticks, names in panels for i in ticks), default=0)
    labels_in = _text_inches(longest) * 0.94 + 0.15    # names rotated 70 degrees
    height = 3.2 + labels_in
    fig, axes = _figure((11, height), ncols=2, sharey=True)
    fig.suptitle(f"Layer profile: relative error per module (log scale), forward then backward  "
                 f"[{verdict.upper()}]", fontsize=10, color=COLOURS.get(verdict, "k"))
    handles: list[Any] = []
    colours: list[str] = []
    for ax, (direction, sel, ticks, names) in zip(axes, panels, strict=True):
        if not sel:
            ax.set_visible(False)
            continue
        vals = [max(float(r["value"]), 1e-12) if np.isfinite(float(r["value"])) else 1e3 for r in sel]
        colours += [COLOURS.get(r.get("verdict"), COLOURS["skipped"]) for r in sel]
        ax.bar(range(len(sel)), vals, color=colours[-len(sel):])
        limits = [float(r["threshold"]) for r in sel]    # each module judged at its own dtype's line
        if len(set(limits)) == 1:
            handles.append(ax.axhline(limits[0], color="grey", ls="--", lw=0.8, label="tolerance"))
        else:
            x = np.arange(len(sel))
            handles.append(ax.hlines(limits, x - 0.45, x + 0.45, colors="grey", linestyles="--", lw=0.8,
                                     label="tolerance (each module's dtype)"))
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([names[i] for i in ticks], rotation=70, fontsize=7, rotation_mode="anchor",
                           ha="right", va="center")
        ax.set_xlim(-0.6, len(sel) - 0.4)
        every = ticks[1] - ticks[0] if len(ticks) > 1 else 1
        ax.set_title(f"{direction} ({sel[0].get('metric', '')})" + (f", one bar in {every} named" if every > 1 else ""),
                     fontsize=9, y=1)   # placed, not auto-placed: that measures the axes once more
        ax.yaxis.set_minor_locator(NullLocator())   # a log axis' minor ticks: ~100 tick objects, not drawn usefully
    legend = _legend_below(fig, _verdict_patches(colours, {"pass": "pass", "warn": "warn",
                                                           "fail": "beyond tolerance (fail)",
                                                           "skipped": "not judged"}) + handles, fontsize=7)
    named = [[names[i] for i in ticks] for _, _, ticks, names in panels]
    _fit_grid(fig, [axes], legend, names=_rotated_names(fig, named))
    return _save(fig, path)


def lr0_pair(rows: list[dict]) -> bytes | None:
    """lr = 0 pair: both losses per step (weights never move) and their delta."""
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = _figure((10, 3.6), ncols=2)
    fig.suptitle("lr = 0 pair: loss per step (weights never move) and its delta", fontsize=10)
    handles = ax1.plot(steps, [r["loss_baseline"] for r in rows], "o-", label="baseline")
    handles += ax1.plot(steps, [r["loss_candidate"] for r in rows], "x--", label="candidate")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (lr = 0)")
    handles += ax2.plot(steps, [r["loss_candidate"] - r["loss_baseline"] for r in rows], ".-", color="#2ca02c",
                        label="candidate - baseline (right)")
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss delta (candidate - baseline)")
    _fit_grid(fig, [[ax1, ax2]], _legend_below(fig, handles))
    return _save(fig, None)


def norm_trajectories(curves: list[dict], what: str, verdict: str, path: Path) -> bytes | None:
    """A few parameters' named-norm trajectories, one panel each: the candidate's relative difference from
    the baseline per step inside the parameter's own band (shaded; the repeats' own differences in grey),
    steps outside it in red, the step the parameter leaves its band marked; one legend under the panels.
    ``curves``: ``steps``, ``rel_delta``, ``rel_band``, ``outside``, ``repeats``, ``departure_step`` and
    ``name`` each."""
    if not curves:
        return None
    ncols = 2 if len(curves) > 1 else 1
    nrows = -(-len(curves) // ncols)
    fig = Figure(figsize=(5.2 * ncols, 2.3 * nrows + 0.8), dpi=DPI)
    FigureCanvasAgg(fig)
    grid = fig.subplots(nrows, ncols, squeeze=False)
    axes = grid.ravel()
    fig.suptitle(f"Per-parameter {what} over the run: (candidate - baseline) / |baseline| in its band  "
                 f"[{verdict.upper()}]", fontsize=10, color=COLOURS.get(verdict, "k"))
    # the envelope's columns: a panel is never wider than its share of the figure
    cols = max(1, round(fig.get_figwidth() * DPI / ncols))
    handles: list[Any] = []
    for ax, c in zip(axes, curves, strict=False):
        x = np.asarray(c["steps"])
        band = np.nan_to_num(np.asarray(c["rel_band"], dtype=np.float64), nan=0.0, posinf=0.0)
        bx, by = envelope(x, band, cols)
        handles.append(ax.fill_between(bx, -by, by, color="#90caf9", alpha=0.5, step="mid", label="band"))
        for r in c.get("repeats", []):
            handles += ax.plot(*envelope(x, np.asarray(r, dtype=np.float64), cols), color="#9e9e9e", lw=0.6,
                               label="repeat - baseline")
        d = np.asarray(c["rel_delta"], dtype=np.float64)
        handles += ax.plot(*envelope(x, d, cols), color="#e07b00", lw=0.9, label="candidate - baseline")
        out = np.asarray(c["outside"], dtype=bool)
        if out.any():
            handles.append(ax.scatter(*envelope(x[out], np.clip(d[out], -1e30, 1e30), cols), s=5,
                                      color=COLOURS["fail"], zorder=3, label="outside its band"))
        if c.get("departure_step") is not None:
            handles.append(ax.axvline(c["departure_step"], color=COLOURS["fail"], ls="--", lw=1.0,
                                      label="leaves its band (step in the panel's title)"))
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"{c['name']}" + (f"  (leaves at step {c['departure_step']})"
                                        if c.get("departure_step") is not None else ""),
                     fontsize=8, color=COLOURS["fail"] if c.get("departure_step") is not None else "k")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(curves):]:
        ax.set_visible(False)
    axes[(nrows - 1) * ncols].set_xlabel("step", fontsize=8)
    _fit_grid(fig, grid, _legend_below(fig, handles, fontsize=7))
    return _save(fig, path)


def isolation_profile(rows: list[dict], named: list[str], verdict: str, path: Path) -> bytes | None:
    """Per module, in execution order: its own error (the candidate's module on the baseline's input, bars)
    and the error in the candidate's own forward (inherited, line); the named module's bar is red."""
    if not rows:
        return None
    names = [str(r["module"]).replace("decoder.layers.", "L").replace("self_attention", "attn") for r in rows]
    ticks = named_bars(len(rows))
    labels_in = _text_inches(max((len(names[i]) for i in ticks), default=0)) * 0.94 + 0.15
    height = 3.2 + labels_in
    fig, ax = _figure((11, height))
    fig.suptitle(f"Single-module isolation: own vs inherited relative error per module (log scale)  "
                 f"[{verdict.upper()}]", fontsize=10, color=COLOURS.get(verdict, "k"))

    def val(v: Any) -> float:
        v = float(v) if v is not None else float("nan")
        return max(v, 1e-12) if np.isfinite(v) else 1e3

    x = np.arange(len(rows))
    is_named = [r["module"] in named for r in rows]
    ax.bar(x, [val(r["own_rel_l2"]) for r in rows], color=[COLOURS["fail"] if n else "#4c72b0" for n in is_named])
    handles: list[Any] = [Patch(color="#4c72b0", label="own error (the candidate's module on the baseline's input)")]
    if any(is_named):
        handles.append(Patch(color=COLOURS["fail"], label="own error of the named module"))
    inh = [val(r.get("inherited_rel_l2")) for r in rows]
    if any(r.get("inherited_rel_l2") is not None for r in rows):
        handles += ax.plot(x, inh, "o-", color="#dd8452", ms=3, lw=1, label="inherited (candidate's own forward)")
    handles.append(ax.hlines([float(r["pass_tol"]) for r in rows], x - 0.45, x + 0.45, colors="grey",
                             linestyles="--", lw=0.8, label="tolerance"))
    ax.set_yscale("log")
    ax.set_xticks(ticks)
    ax.set_xticklabels([names[i] for i in ticks], rotation=70, fontsize=7, rotation_mode="anchor", ha="right",
                       va="center")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.yaxis.set_minor_locator(NullLocator())
    _fit_grid(fig, ax, _legend_below(fig, handles, fontsize=7), names=_rotated_names(fig, [[names[i] for i in ticks]]))
    return _save(fig, path)
