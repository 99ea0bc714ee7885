"""Layer tensors of a parallel run put back together (sources.layers.gather_layers) without a training run:
parts joined (SP inside CP, a gated fc1's TP halves), statistics combined, rows left out and said so. The
real TP / SP / CP / PP / EP stores are compared in test_megatron_layouts.py."""

from __future__ import annotations

import numpy as np
import pytest

from runstore import cp_split


def _stats(x: np.ndarray) -> dict:
    x64 = x.astype(np.float64)
    return {"numel": x.size, "max": float(x.max()), "min": float(x.min()), "mean": float(x64.mean()),
            "norm": float(np.sqrt((x64 ** 2).sum())), "nan": 0, "inf": 0}


def test_layer_parts_join_and_their_statistics_combine() -> None:
    """SP inside CP (the sequence dim split by CP's zig-zag, then by TP) and a gated fc1's [gate_r | up_r]
    TP halves join into the whole tensor; the parts' statistics combine into the whole's."""
    from sources.layers import combine_stats, join_parts, parse_split

    rng = np.random.default_rng(0)
    whole = rng.standard_normal((8, 2, 12)).astype(np.float32)
    parts = [np.split(cp_split(whole, 2, c, 0), 2, axis=0) for c in range(2)]   # parts[cp][tp]
    assert parse_split("tp:0,cp:0") == ((False, 0), 0)
    np.testing.assert_array_equal(join_parts(parts, (False, 0), 0), whole)
    got = combine_stats([_stats(p) for row in parts for p in row])
    for k, v in _stats(whole).items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    gate, up = np.split(whole, 2, axis=-1)
    halves = [np.concatenate([g, u], axis=-1) for g, u in zip(np.split(gate, 2, -1), np.split(up, 2, -1), strict=True)]
    assert parse_split("tp:g-1") == ((True, -1), None)
    np.testing.assert_array_equal(join_parts([halves], (True, -1), None), whole)
    assert not np.array_equal(join_parts([halves], (False, -1), None), whole)   # plain concatenation is not it


class _Ranks:
    """Four ranks (TP=2 x CP=2) of a store's layer rows, statistics only."""

    root = "fake"
    needs_readers = False

    def __init__(self, rows: dict[int, list[dict]]) -> None:
        self.rows = rows

    def array_steps(self) -> list[int]:
        return [1]

    def array_ranks(self, step: int) -> list[int]:
        return sorted(self.rows)

    def rank_info(self, rank: int) -> dict:
        return {"rank": rank, "tp_rank": rank % 2, "cp_rank": rank // 2, "dp_rank": 0, "tp": 2, "cp": 2}

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict], bool]:
        return [dict(r) for r in self.rows[rank]], False


def test_gathered_rows_shapes_statistics_and_what_is_left_out() -> None:
    from sources.layers import gather_layers

    rng = np.random.default_rng(1)
    whole = rng.standard_normal((8, 2, 4)).astype(np.float32)
    rows: dict[int, list[dict]] = {}
    for rank in range(4):
        tp, cp = rank % 2, rank // 2
        part = np.split(cp_split(whole, 2, cp, 0), 2, axis=-1)[tp]
        mine = [{"order": 0, "module": "m", "kind": "forward.output.0", "dtype": "float32", "shape": "4x2x2",
                 "split": "tp:-1,cp:0", **_stats(part)},
                {"order": 1, "module": "m.inner", "kind": "forward.output.0", "dtype": "float32", "shape": "2x2",
                 "split": "cp:x", **_stats(part[0])},
                {"order": 2, "module": "norm", "kind": "forward.output.0", "dtype": "float32", "shape": "4x2x4",
                 "split": "cp:0", **_stats(cp_split(whole, 2, cp, 0))}]
        rows[rank] = mine if cp == 0 else mine[:2]     # CP rank 1 lost its norm rows (TP rank 0's would do)
    src = gather_layers(_Ranks(rows))
    assert src.array_ranks(1) == [0]
    got, has = src.layer_rows(1)
    assert not has and [r["module"] for r in got] == ["m"]
    assert got[0]["shape"] == "8x2x4" and got[0]["gathered_from"] == 4
    for k, v in _stats(whole).items():
        assert got[0][k] == pytest.approx(v, rel=1e-6), k
    assert src.notes[1] == ["rows gathered from ranks [0, 1, 2, 3] (DP rank 0)",
                            "1 rows left out: CP parts in no sequence order (attention internals; first: m.inner "
                            "forward.output.0)",
                            "1 rows left out: parts of them missing (first: norm forward.output.0: CP rank 1 of 2 "
                            "absent)"]
    # a store whose rows record no split (a plain torch / MindSpore dumper): TP / CP rank 0's rows, said so
    for r in rows.values():
        for row in r:
            row.pop("split")
    plain = gather_layers(_Ranks(rows))
    got, _ = plain.layer_rows(1)
    assert got[0]["shape"] == "4x2x2" and "record no split: TP / CP rank 0's taken as the whole" in plain.notes[1][1]
