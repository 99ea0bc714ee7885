"""Every figure the report draws keeps its texts inside the canvas and its legend off the data, and its legend
names every marker it draws (issue 36 item 5), checked on the Agg canvas each figure is drawn on.

Each figure is caught as reports.figures saves it (the curve figure is reused for the next plot, so it is
measured there and then). The checks:
- texts: every Text artist that really drew (tick labels, axis labels, titles, offset texts such as "1e-5",
  legend entries) lies inside the figure's bbox (1 px of rounding allowed);
- legend off the data: no data point of a line, scatter or band inside the axes falls inside a legend's box,
  and no bar meets it;
- markers named: every line and collection drawn (curves, scatter markers, the divergence / first non-finite /
  leaves-its-band steps, tolerance lines) carries a label some legend shows, horizontal reference lines that
  span the axes (zero, layer separators) excepted, and every bar colour is a patch of a legend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection, PathCollection, PolyCollection
from matplotlib.colors import to_hex
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from align.procedure import report
from align.stages import Inputs
from demo.example_logs import megatron_log, mindformers_log
from reports import figures, render

MCORE = ["embedding.word_embeddings.weight"] + [
    f"decoder.layers.{i}.{p}" for i in range(2) for p in (
        "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")] + ["decoder.final_layernorm.weight", "output_layer.weight"]
MODULES = ["embedding"] + [f"decoder.layers.{i}.{m}" for i in range(2) for m in (
    "input_layernorm", "self_attention.core_attention", "self_attention", "pre_mlp_layernorm", "mlp")] + \
    ["decoder.final_layernorm", "output_layer"]


def _inside(bb, fig) -> bool:
    w, h = fig.bbox.width, fig.bbox.height
    return bb.x0 >= -1 and bb.y0 >= -1 and bb.x1 <= w + 1 and bb.y1 <= h + 1


def _reference(line: Line2D) -> bool:
    """A horizontal line across the whole axes (axhline: the zero line, a layer separator)."""
    x, y = np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)
    return len(y) == 2 and y[0] == y[1] and list(x) == [0.0, 1.0]


def _points(ax) -> np.ndarray:
    """Display coordinates of every data point of the axes' lines, scatters and bands that lie in its box."""
    pts = [np.empty((0, 2))]
    for line in ax.lines:
        if not _reference(line) and len(line.get_xydata()) > 2:
            pts.append(line.get_transform().transform(line.get_xydata()))
    for coll in ax.collections:
        if isinstance(coll, PathCollection):
            pts.append(coll.get_offset_transform().transform(coll.get_offsets()))
        elif isinstance(coll, PolyCollection):
            pts += [coll.get_transform().transform(p.vertices) for p in coll.get_paths()]
    xy = np.concatenate(pts)
    xy = xy[np.isfinite(xy).all(axis=1)]
    b = ax.bbox
    return xy[(xy[:, 0] > b.x0) & (xy[:, 0] < b.x1) & (xy[:, 1] > b.y0) & (xy[:, 1] < b.y1)]


def check(fig, texts: list[Text]) -> dict:
    """The three checks on a figure just drawn; returns what it saw (for the caller's own asserts)."""
    renderer = fig.canvas.get_renderer()
    assert texts, "no text drew"
    for t in texts:
        bb = t.get_window_extent(renderer)
        assert _inside(bb, fig), (f"text {t.get_text()!r} at {bb.bounds} leaves the {fig.bbox.width:.0f} x "
                                  f"{fig.bbox.height:.0f} canvas")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    legends = [*fig.legends, *(ax.get_legend() for ax in axes if ax.get_legend() is not None)]
    assert legends, "no legend"
    labels = {t.get_text() for leg in legends for t in leg.get_texts()}
    patch_colours = {to_hex(h.get_facecolor(), keep_alpha=False) for leg in legends for h in leg.legend_handles
                     if isinstance(h, Patch)}
    for leg in legends:
        box = leg.get_window_extent(renderer)
        for ax in axes:
            xy = _points(ax)
            inside = (xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)
            assert not inside.any(), f"the legend covers {int(inside.sum())} data points"
            for bar in ax.patches:
                if isinstance(bar, Rectangle) and bar.get_visible():
                    bb = Bbox.intersection(bar.get_window_extent(renderer), ax.bbox)   # what the axes shows
                    assert bb is None or Bbox.intersection(bb, box) is None, "the legend covers a bar"
    for ax in axes:
        for line in ax.lines:
            assert _reference(line) or line.get_label() in labels, f"line {line.get_label()!r} not in the legend"
        for coll in ax.collections:
            if isinstance(coll, (PathCollection, PolyCollection, LineCollection)):
                assert coll.get_label() in labels, f"marker {coll.get_label()!r} not in the legend"
        bars = {to_hex(p.get_facecolor(), keep_alpha=False) for p in ax.patches if isinstance(p, Rectangle)}
        assert bars <= patch_colours, f"bar colours {bars - patch_colours} not in the legend"
    return {"labels": labels, "texts": [t.get_text() for t in texts]}


@pytest.fixture
def drawn(monkeypatch):
    """Checks each figure as reports.figures saves it; the list of what each check saw."""
    seen: list[dict] = []
    real_save, real_draw = figures._save, Text.draw

    def save(fig, path):
        texts: list[Text] = []

        def draw(self, renderer):
            real_draw(self, renderer)
            if self.get_visible() and self.get_text():     # what Text.draw itself draws
                texts.append(self)

        Text.draw = draw
        try:
            data = real_save(fig, path)
        finally:
            Text.draw = real_draw
        seen.append(check(fig, texts))
        return data

    monkeypatch.setattr(figures, "_save", save)
    return seen


@pytest.mark.parametrize("fault", ["diverge", "nan"])
def test_report_curves(tmp_path, drawn, monkeypatch, fault):
    """The four curve figures of a log report (loss and grad norm, each against its band), drawn by the stages
    as `align report` draws them: the divergence step and the first non-finite step are legend entries."""
    monkeypatch.setattr(render, "PARALLEL", False)
    base, rep, cand = tmp_path / "b.log", tmp_path / "r.log", tmp_path / "c.log"
    megatron_log(base, 400, seed=1)
    megatron_log(rep, 400, seed=2)
    mindformers_log(cand, 400, seed=3, fault=fault, fault_step=250)
    report(Inputs(str(base), str(cand), repeats=[str(rep)]), str(tmp_path / "out"))
    assert len(drawn) == 4
    marks = {lab for d in drawn for lab in d["labels"]}
    want = "divergence from step" if fault == "diverge" else "first NaN/Inf at step"
    assert any(lab.startswith(want) for lab in marks), marks
    # a divergence leaves the band at finite steps; the NaN run's finite steps are clean noise, inside a band
    # made for a candidate up to --noise-allowance times noisier than the repeat (its NaN steps have their entry)
    if fault == "diverge":
        assert any(lab.startswith("outside band") for lab in marks)


@pytest.mark.parametrize("scale", [1e-7, 1e-3, 3e4])
def test_long_curves_any_scale(tmp_path, drawn, scale):
    """100k steps at scales whose tick labels are long ("-0.00015") or carry an offset text ("1e-7"): the
    y label of the delta figure stays on the canvas."""
    n = 100_000
    rng = np.random.default_rng(0)
    x = np.arange(1, n + 1)
    base = 10.63 + scale * np.cumsum(rng.standard_normal(n)) / 300
    cand = base + scale * rng.standard_normal(n)
    rep = base + scale * rng.standard_normal(n)
    t = pd.DataFrame({"baseline": base, "candidate": cand, "repeat1": rep, "repeat2": rep[::-1], "delta": cand - base,
                      "band": np.full(n, 2 * scale), "outside": np.abs(cand - base) > 2 * scale}, index=x)
    labels = {"baseline": "baseline: megatron_baseline.log", "candidate": "candidate: mindformers_candidate.log"}
    assert figures.loss_curves(t, labels, "pass", tmp_path / "l.png", title="Loss")
    assert figures.delta_band(t, "fail", tmp_path / "d.png", 61_234, 99_999, title="Loss delta")
    assert len(drawn) == 2
    assert {"divergence from step 61234", "first NaN/Inf at step 99999", "repeat2 - baseline"} <= drawn[1]["labels"]


def _params(names: list[str], rng) -> list[dict]:
    return [{"name": n, "layer": int(n.split(".")[2]) if n.startswith("decoder.layers.") else None,
             "kind": "embedding" if n.startswith("embedding") else "x", "rel_diff": 10 ** rng.uniform(-7, -1)}
            for n in names]


def test_bar_figures(tmp_path, drawn):
    """Local norms (19 mcore parameters; 600 of a deep model with NaN and missing ones), weights with one
    tolerance each, the layer profile (mixed dtypes' lines; 600 modules a panel, one name in k) and the
    isolation profile: bar colours and tolerance lines in the legend, names on the canvas."""
    rng = np.random.default_rng(1)
    assert figures.local_norm_chart(_params(MCORE, rng), 5e-3, "warn", tmp_path / "a.png")
    deep = _params([f"decoder.layers.{i // 12}.mlp.experts.local_experts.{i % 12}.linear_fc1.weight"
                    for i in range(600)], rng)
    deep += [{"name": "output_layer.weight", "layer": None, "kind": "output", "rel_diff": None},
             {"name": "decoder.layers.3.p0.weight", "layer": 3, "kind": "x", "rel_diff": float("nan")}]
    assert figures.local_norm_chart(deep, 1e-4, "fail", tmp_path / "b.png")
    weights = [{"name": n, "layer": None, "kind": "x", "rel_l2": 10 ** rng.uniform(-8, -2), "tolerance": tol,
                "verdict": v}
               for n, tol, v in zip(MCORE, [1e-6, 1e-3] * 10, ["pass", "warn", "fail"] * 7, strict=False)]
    assert figures.weights_chart(weights, "fail", tmp_path / "c.png")
    rows = [{"direction": d, "module": m, "value": 10 ** rng.uniform(-8, -2), "metric": "stats_rel_diff",
             "threshold": 1e-5 if k < 2 else 8e-4, "verdict": ["pass", "warn", "fail"][k % 3]}
            for d in ("forward", "backward") for k, m in enumerate(MODULES if d == "forward" else MODULES[::-1])]
    assert figures.layer_profile(rows, "fail", tmp_path / "d.png")
    many = [{"direction": d, "module": f"decoder.layers.{i // 12}.mlp.linear_fc1", "value": 1e-6, "verdict": "pass",
             "threshold": 1e-4, "metric": "rel_l2"} for d in ("forward", "backward") for i in range(600)]
    assert figures.layer_profile(many, "pass", tmp_path / "e.png")
    iso = [{"module": m, "own_rel_l2": 10 ** rng.uniform(-7, -3), "inherited_rel_l2": 10 ** rng.uniform(-6, -2),
            "pass_tol": 1e-4} for m in MODULES]
    assert figures.isolation_profile(iso, [MODULES[4]], "fail", tmp_path / "f.png")
    assert len(drawn) == 6
    assert "own error of the named module" in drawn[5]["labels"]
    assert any("drawn at 1e3" in lab for lab in drawn[1]["labels"])


def test_trajectories_and_lr0(tmp_path, drawn):
    """Parameter trajectories (100k steps, outside points and a departure step) and the lr = 0 pair (a delta of
    1e-6: an offset text above the right panel): one legend under the panels names every marker."""
    rng = np.random.default_rng(2)
    n = 100_000
    curves = [{"name": name, "steps": np.arange(1, n + 1), "rel_delta": 1e-3 * rng.standard_normal(n),
               "rel_band": np.full(n, 2.5e-3), "outside": rng.random(n) < 0.005,
               "repeats": [1e-3 * rng.standard_normal(n)], "departure_step": 71_000 if k == 0 else None}
              for k, name in enumerate(MCORE[:5])]
    assert figures.norm_trajectories(curves, "gradient norm", "fail", tmp_path / "t.png")
    rows = [{"step": s, "loss_baseline": 4.84 + 0.03 * np.sin(s), "loss_candidate": 4.84 + 0.03 * np.sin(s) + 1e-6 * s}
            for s in range(1, 21)]
    assert figures.lr0_pair(rows)
    assert len(drawn) == 2
    assert {"outside its band", "band", "repeat - baseline"} <= drawn[0]["labels"]
    assert any(lab.startswith("leaves its band") for lab in drawn[0]["labels"])
    assert any("1e" in t and "5" in t or "1e" in t and "6" in t for t in drawn[1]["texts"]), drawn[1]["texts"]


def test_the_checks_catch_the_old_faults(tmp_path):
    """The checks fail on what the issue saw: a y label pushed off the canvas and a legend on the curve."""
    fig, ax = figures._figure(figures.CURVE_SIZE)
    fig.subplots_adjust(left=0.02)
    ax.plot(np.arange(100), np.linspace(0, 1, 100), label="candidate - baseline")
    ax.set_ylabel("candidate - baseline")
    ax.legend(loc="center")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    with pytest.raises(AssertionError, match="leaves the"):
        check(fig, [ax.yaxis.label])
    fig.subplots_adjust(left=0.2)
    fig.canvas.draw()
    assert _inside(ax.yaxis.label.get_window_extent(r), fig)
    with pytest.raises(AssertionError, match="legend covers"):
        check(fig, [ax.yaxis.label])
    assert Path(tmp_path).is_dir()
