"""reports.figures.envelope: a long series is drawn from each pixel column's minimum and maximum (plus its first
and last point), so the figure looks the same and a one-step spike stays visible; short series are untouched."""

from __future__ import annotations

import numpy as np

from reports.figures import COLUMNS, envelope


def _columns(x: np.ndarray, columns: int) -> np.ndarray:
    """Each point's column as the docstring defines it: the x range cut into ``columns`` equal columns."""
    pos = x.astype(np.float64)
    return np.minimum(((pos - pos[0]) * (columns / (pos[-1] - pos[0]))).astype(np.int64), columns - 1)


def _check(x: np.ndarray, y: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray]:
    ex, ey = envelope(x, y, columns)
    assert len(ex) == len(ey) <= 2 * columns + 2
    assert np.all(np.diff(ex) > 0)                                   # in step order, each point once
    idx = np.searchsorted(x, ex)
    assert np.array_equal(x[idx], ex) and np.array_equal(y[idx], ey, equal_nan=True)   # points of the series
    assert ex[0] == x[0] and ex[-1] == x[-1]
    assert np.array_equal(ey[[0, -1]], y[[0, -1]], equal_nan=True)
    col, kept = _columns(x, columns), _columns(ex, columns)
    for k in np.unique(col):
        vals, mine = y[col == k], ey[kept == k]
        if np.isnan(vals).all():
            assert np.isnan(mine).any()                              # the gap the full curve shows
        else:
            assert np.nanmin(vals) in mine and np.nanmax(vals) in mine
    return ex, ey


def test_long_series_keeps_every_columns_min_max_and_ends() -> None:
    rng = np.random.default_rng(0)
    n = 100_000
    x = np.arange(1, n + 1)
    y = 3.0 + 0.01 * rng.standard_normal(n)
    y[[1234, 77_777]] = [50.0, -50.0]                                # one-step spike and dip
    ex, ey = _check(x, y, COLUMNS)
    assert len(ex) < 2 * COLUMNS + 3 and {50.0, -50.0} <= set(ey)


def test_uneven_steps_nan_and_small_column_counts() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([np.arange(0, 30_000, 3), np.arange(200_000, 260_000, 7)])   # a gap in the steps
    y = rng.standard_normal(len(x)).cumsum()
    y[::11] = np.nan                                                 # NaN values inside columns: skipped
    y[-3000:-1500] = np.nan                                          # whole columns of NaN: a gap
    for columns in (1, 7, 97, 810):
        _check(x, y, columns)


def test_short_series_untouched() -> None:
    x = np.arange(2 * COLUMNS)
    y = np.linspace(0.0, 1.0, len(x))
    ex, ey = envelope(x, y)
    assert ex is x and ey is y
    ex, ey = envelope(x[:5], [1.0, 2.0, 3.0, 2.0, 1.0])
    assert list(ey) == [1.0, 2.0, 3.0, 2.0, 1.0]


def test_steps_out_of_order_cut_by_position() -> None:
    rng = np.random.default_rng(2)
    x = rng.permutation(50_000)
    y = rng.standard_normal(len(x))
    ex, ey = envelope(x, y, 50)
    assert len(ex) <= 102 and y.min() in ey and y.max() in ey
    assert ex[0] == x[0] and ex[-1] == x[-1]
