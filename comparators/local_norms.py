"""Step-1 local norms (per-parameter gradient L2 norms) of two runs, compared through a name mapping.

Why this works across frameworks and parallel layouts: every mapping transform only moves elements, so the
norm of a fused parameter equals sqrt(sum of squares) of its parts' norms; and a TP-sharded parameter's
full norm is sqrt(sum over its TP group of the shard norms^2), while a duplicated parameter (norm weights,
``tp_partition_dim == -1``) is counted once. With the distributed optimizer each DP rank records only its
reduce-scattered part of a parameter (``dp_shard == 1``, ``dp_rank``, ``dp_size``): the parts' squares add
up to the full gradient's. Names are global (pipeline stages and EP ranks renamed by the dumper), so the
ranks of a pipeline or of an expert-parallel group just contribute different names. Sequence parallelism
changes nothing here: its norm / bias gradients are TP-duplicated once finalize_model_grads has all-reduced
them, which is where the dumper reads them; context-parallel ranks are replicas like DP ranks (gradients
all-reduced over DP x CP), and replicas that disagree are named. Reading is streaming:
only the ``local_norm`` group of each rank file is read, one file at a time, so memory grows with the
number of parameters, not with the dump.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from comparators import noise_floor as nf
from core.errors import BadInput
from core.findings import Finding, StageResult
from models.mindformers_parallel import ALL_REDUCED, PIPELINE_UNVERIFIED, PRE_ALL_REDUCE, param_stage
from runstore import check_table, table_columns
from runstore.h5file import open_h5

STAGE = "step1_local_norm"
# Relative tolerance of a local norm by compute dtype: (pass up to, warn up to); beyond is a fail.
# float32 cross-framework noise on identical weights and data is ~1e-6..1e-5 relative; bf16 keeps 8 bits.
RTOL = {"float32": (1e-4, 1e-2), "float16": (5e-3, 5e-2), "bfloat16": (2e-2, 1e-1)}


@dataclass
class ShardNorm:
    """Squared-norm pieces of one parameter seen on the ranks of one run."""

    partition_dim: int
    tp_size: int
    shards: dict[int, float]        # tp_rank -> norm
    numel: dict[int, int]           # tp_rank -> numel of the shard
    pp_ranks: set[int]
    disagree: float = 0.0           # duplicated parameter: largest relative spread between TP ranks
    replica_disagree: float = 0.0   # largest relative spread between DP / CP replicas of one TP shard
    dp_size: int = 1                # > 1: gradient reduce-scattered over DP ranks (distributed optimizer)
    dp_parts: dict[int, dict[int, tuple[float, int]]] | None = None  # tp_rank -> dp_rank -> (norm, numel)
    rows: dict[tuple[int, int], int] = field(default_factory=dict)  # (tp_rank, dp_rank or -1) -> row kept
    # gradients read before the DP all-reduce (MindFormers' TrainingStateMonitor, data-parallel mode): each
    # DP rank's own gradient, tp_rank -> dp_rank -> norm; the all-reduced norm is not known, only bounded
    pre_reduce: dict[int, dict[int, float]] | None = None
    reduce_mean: bool = False       # the all-reduce averages (gradients_mean) rather than sums
    origin: str = ""                # the table that first gave this parameter's layout (named when another disagrees)

    def add(self, tp_rank: int, norm: float, numel: int, dp_shard: int = 0, dp_rank: int = 0,
            dp_size: int = 1, row: int = -1, pre_reduce: bool = False) -> None:
        """One rank's row: a whole (TP shard of the) gradient, or a DP rank's part of it. ``row`` (its index
        in the rows read) is remembered when the row is kept, so the same combination can be replayed on
        other steps' norms without this loop (``contributing_rows``). ``pre_reduce``: the row is one DP rank's
        own gradient before the all-reduce (kept per DP rank, never taken for a replica)."""
        if pre_reduce:
            if self.pre_reduce is None:
                self.pre_reduce = {}
            self.pre_reduce.setdefault(tp_rank, {}).setdefault(dp_rank, norm)
            self.numel.setdefault(tp_rank, int(numel))
            self.rows.setdefault((tp_rank, dp_rank), row)
            self.shards[tp_rank] = self._bound(self.pre_reduce[tp_rank])
            return
        if dp_shard and dp_size > 1:
            self.dp_size = max(self.dp_size, int(dp_size))
            if self.dp_parts is None:
                self.dp_parts = {}
            parts = self.dp_parts.setdefault(tp_rank, {})
            if dp_rank in parts:
                return
            parts[dp_rank] = (norm, numel)
            self.rows[(tp_rank, dp_rank)] = row
            self.shards[tp_rank] = math.sqrt(sum(v * v for v, _ in parts.values()))
            self.numel[tp_rank] = sum(n for _, n in parts.values())
            return
        if tp_rank in self.shards:   # a DP or CP replica: the all-reduced gradient, the same on every replica
            ref = self.shards[tp_rank]
            self.replica_disagree = max(self.replica_disagree, abs(norm - ref) / max(abs(ref), 1e-30))
            return
        if self.partition_dim < 0 and self.shards:
            ref = next(iter(self.shards.values()))
            self.disagree = max(self.disagree, abs(norm - ref) / max(abs(ref), 1e-30))
        self.shards[tp_rank] = norm
        self.numel[tp_rank] = int(numel)
        self.rows[(tp_rank, -1)] = row

    def _bound(self, per_dp: dict[int, float]) -> float:
        """The all-reduced norm's upper bound from the DP ranks' own norms (triangle inequality): their sum
        (mean under gradients_mean); reached when the ranks' gradients point the same way."""
        total = sum(per_dp.values())
        return total / len(per_dp) if self.reduce_mean else total

    def dp_rank_norm(self, dp_rank: int) -> float | None:
        """A pre-all-reduce entry's norm on one DP rank (its TP slices combined), None if that rank has none."""
        if not self.pre_reduce:
            return None
        vals = {tp: parts[dp_rank] for tp, parts in self.pre_reduce.items() if dp_rank in parts}
        if not vals:
            return None
        if self.partition_dim < 0:
            return vals[min(vals)]
        return math.sqrt(sum(v * v for v in vals.values()))

    def contributing_rows(self) -> list[int]:
        """The rows whose squares sum to ``full_norm() ** 2``: every kept row of a TP-partitioned parameter,
        the lowest TP rank's rows of a duplicated one."""
        if self.partition_dim < 0:
            low = min(self.shards)
            return [r for (tp, _), r in self.rows.items() if tp == low]
        return list(self.rows.values())

    def full_norm(self) -> float:
        if self.partition_dim < 0:
            return self.shards[min(self.shards)]
        return math.sqrt(sum(v * v for v in self.shards.values()))

    def full_numel(self) -> int:
        if self.partition_dim < 0:
            return self.numel[min(self.numel)]
        return sum(self.numel.values())

    @property
    def missing_shards(self) -> list[int]:
        if self.partition_dim < 0:
            return []
        return [r for r in range(self.tp_size) if r not in self.shards]

    @property
    def missing_dp_parts(self) -> list[int]:
        """DP ranks whose part of a reduce-scattered gradient was not read (any TP rank)."""
        if not self.dp_parts:
            return []
        return sorted({d for parts in self.dp_parts.values() for d in range(self.dp_size) if d not in parts})


def _rank_file(reader: Any, step: int, rank: int) -> Path:
    return Path(reader.step_file(step, rank))


GRAD_STATES = (ALL_REDUCED, PRE_ALL_REDUCE, PIPELINE_UNVERIFIED)


def _read_group(path: Path, group: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """One rank's table and its attributes, checked (runstore.check_table: columns, types, norms >= 0, ranks
    below sizes; table_attrs: the attributes read here)."""
    try:
        with open_h5(path) as h5:
            if group not in h5:
                return None
            g = h5[group]
            cols = table_columns(g)
            attrs = {k: g.attrs[k] for k in g.attrs}
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise BadInput(f"{path}: '{group}' not readable ({' '.join(str(exc).split())[:120]})") from None
    check_table(path, group, cols)
    return cols, table_attrs(path, group, attrs)


def table_attrs(path: Path | str, group: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """A local-norm table's attributes as plain values: ``global_norm`` a real number (NaN allowed: evidence),
    ``grad_state`` one of GRAD_STATES. One-line BadInput naming the file and the attribute otherwise."""
    out = dict(attrs)
    if "global_norm" in out:
        v = out["global_norm"]
        v = v.item() if isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.size == 1) else v
        if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, int) and abs(v) >= 1 << 1023):
            raise BadInput(f"{path}: '{group}' attribute 'global_norm': {v!r:.40} is not a number")
        if float(v) < 0:
            raise BadInput(f"{path}: '{group}' attribute 'global_norm': {v!r:.40} is negative")
        out["global_norm"] = float(v)
    if "grad_state" in out:
        v = out["grad_state"]
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        if not isinstance(v, str) or v not in GRAD_STATES:
            raise BadInput(f"{path}: '{group}' attribute 'grad_state': {v!r:.40} is not one of "
                           f"{', '.join(GRAD_STATES)}")
        out["grad_state"] = v
    return out


def read_local_norms(run: str | os.PathLike | Any, step: int = 1
                     ) -> tuple[dict[str, ShardNorm], dict[str, Any]]:
    """Combine one run's per-rank ``local_norm`` tables of ``step`` into one entry per parameter.

    DP replicas hold the same reduced gradient: the first rank seen for a (name, tp_rank) wins; rows with
    ``dp_shard == 1`` are parts of a reduce-scattered gradient and are combined over ``dp_rank``.
    """
    from runstore import RunReader

    if getattr(run, "store", False) is None and hasattr(run, "local_norm_table"):
        return _norms_from_table(run, step)
    reader = run if hasattr(run, "array_ranks") else RunReader(run)
    ranks = reader.array_ranks(step)
    if not ranks:
        raise BadInput(f"{reader.root}: no complete array file for step {step}")
    out: dict[str, ShardNorm] = {}
    info: dict[str, Any] = {"ranks": ranks, "global_norm": None, "tables": 0}
    par = dict((getattr(reader, "meta", None) or {}).get("parallel") or {})
    for rank in ranks:
        got = _read_group(_rank_file(reader, step, rank), "local_norm")
        if got is None:
            continue
        cols, attrs = got
        info["tables"] += 1
        if info["global_norm"] is None and "global_norm" in attrs:
            info["global_norm"] = float(attrs["global_norm"])
        state = str(attrs.get("grad_state", ALL_REDUCED))
        if state != ALL_REDUCED:
            info.setdefault("grad_state", {})[state] = info.get("grad_state", {}).get(state, 0) + 1
        rinfo = reader.rank_info(rank)
        cols, dropped = own_stage_rows(cols, par, rank)
        info["other_stage_rows"] = info.get("other_stage_rows", 0) + dropped
        stage = {"pp_rank": pipeline_stage(par, rank)} if "layer_stages" in par else {}
        add_rank_table(out, cols, {**rinfo, **stage},
                       pre_reduce=state == PRE_ALL_REDUCE and int(par.get("dp", 1) or 1) > 1,
                       reduce_mean=bool(par.get("gradients_mean")), source=str(_rank_file(reader, step, rank)))
    if info["tables"] == 0:
        raise BadInput(f"{reader.root}: step {step} has no local_norm table on any rank")
    info["tp"] = max((e.tp_size for e in out.values()), default=1)
    return out, info


_LOCAL_EXPERT = re.compile(r"^(?P<pre>.*\.experts\.local_experts\.)(?P<e>\d+)(?P<post>\..*)$")
_GROUPED_EXPERT = re.compile(r"^(?P<pre>.*\.experts\.linear_fc\d+\.(?:weight|bias))(?P<e>\d+)(?P<post>)$")


def global_expert_names(names: list[str], ep_rank: int) -> list[str]:
    """Megatron expert names of EP rank ``ep_rank`` by their global index (ep_rank x local experts + e).

    Names that are global already (the MegatronDumper renames them) stay: on an EP rank r > 0 global indices
    start at r x local experts > 0, so an experts module whose lowest index there is 0 was named locally
    (a store from another writer), and its indices are shifted by r x its count of local experts."""
    if ep_rank <= 0:
        return names
    found: dict[str, set[int]] = {}
    parsed = []
    for n in names:
        m = _LOCAL_EXPERT.match(n) or _GROUPED_EXPERT.match(n)
        parsed.append(m)
        if m:
            found.setdefault(m.group("pre"), set()).add(int(m.group("e")))
    shift = {pre: ep_rank * len(es) for pre, es in found.items() if min(es) == 0}
    if not shift:
        return names
    return [f"{m.group('pre')}{int(m.group('e')) + shift[m.group('pre')]}{m.group('post')}"
            if m and m.group("pre") in shift else n for n, m in zip(names, parsed, strict=True)]


def pipeline_stage(par: dict[str, Any], rank: int) -> int:
    """A MindFormers rank's pipeline stage: stage-major ranks (``world / pp`` per stage)."""
    pp = int(par.get("pp", 1) or 1)
    per_stage = max(1, int(par.get("world_size", pp) or pp) // pp)
    return int(rank) // per_stage


def own_stage_rows(cols: dict[str, np.ndarray], par: dict[str, Any], rank: int
                    ) -> tuple[dict[str, np.ndarray], int]:
    """A MindFormers pipeline rank's rows of the parameters its stage owns (``parallel.layer_stages`` in the
    store's meta): every rank builds the whole model with global names, so rows of other stages' parameters
    are not that rank's gradients. Other stores: all rows."""
    stages = par.get("layer_stages")
    if not stages:
        return cols, 0
    pp = int(par.get("pp", 1))
    mine = pipeline_stage(par, rank)
    keep = np.array([param_stage(str(n), list(stages), pp) == mine for n in cols["name"]], dtype=bool)
    if keep.all():
        return cols, 0
    return {k: np.asarray(v)[keep] for k, v in cols.items()}, int((~keep).sum())


def add_rank_table(out: dict[str, ShardNorm], cols: dict[str, np.ndarray], rinfo: dict[str, Any],
                   row0: int = 0, *, pre_reduce: bool = False, reduce_mean: bool = False, source: str = "") -> None:
    """Add one rank's ``local_norm`` table to ``out`` (name -> ShardNorm); row ``i`` is remembered as
    ``row0 + i``. Missing layout columns default to a whole, unsharded gradient on the rank's TP rank.
    ``pre_reduce``: the rows are this DP rank's gradients before the all-reduce (``grad_state``).
    Experts named locally on an EP rank get their global index (``global_expert_names``). A parameter whose
    TP size or partition dim differs from another rank's row of it is a BadInput naming ``source`` (the
    table's file) and the first table: its shards could not be combined."""
    pp_rank = int(rinfo.get("pp_rank", 0) or 0)
    n = len(cols["name"])
    names = global_expert_names([str(x) for x in cols["name"]], int(rinfo.get("ep_rank", 0) or 0))
    tp_rank = cols.get("tp_rank", np.full(n, int(rinfo.get("tp_rank", 0) or 0)))
    tp_size = cols.get("tp_size", np.ones(n, dtype=np.int64))
    pdim = cols.get("tp_partition_dim", np.full(n, -1))
    numel = cols.get("numel", np.zeros(n, dtype=np.int64))
    dp_shard = cols.get("dp_shard", np.zeros(n, dtype=np.int64))
    dp_rank = cols.get("dp_rank", np.full(n, int(rinfo.get("dp_rank", 0) or 0)))
    dp_size = cols.get("dp_size", np.ones(n, dtype=np.int64))
    for i in range(n):
        name = names[i]
        e = out.get(name)
        if e is None:
            e = out[name] = ShardNorm(int(pdim[i]), int(tp_size[i]), {}, {}, set(), origin=source)
        elif e.tp_size != int(tp_size[i]) or e.partition_dim != int(pdim[i]):
            key, here, there = (("tp_size", int(tp_size[i]), e.tp_size) if e.tp_size != int(tp_size[i]) else
                                ("tp_partition_dim", int(pdim[i]), e.partition_dim))
            raise BadInput(f"{source or 'local_norm table'}: key 'local_norm/{key}': {name} has {key} {here} "
                           f"here, {there} in {e.origin or 'an earlier rank'}'s table")
        e.pp_ranks.add(pp_rank)
        e.reduce_mean = reduce_mean
        e.add(int(tp_rank[i]), float(cols["norm"][i]), int(numel[i]), int(dp_shard[i]), int(dp_rank[i]),
              int(dp_size[i]), row0 + i, pre_reduce=pre_reduce)


def _norms_from_table(run: Any, step: int) -> tuple[dict[str, ShardNorm], dict[str, Any]]:
    """Named norms a log carried (MindFormers' TrainingStateMonitor lines), one table per step in memory.

    A table with a ``rank`` column (msrun worker logs) keeps the lowest rank's row per name: a log gives no
    TP layout, so ranks are read as data-parallel replicas.
    """
    table = run.local_norm_table(step)
    if table is None or not len(table):
        raise BadInput(f"{run.path}: step {step} has no local norms")
    check_table(run.path, "local_norm", {c: table[c].to_numpy() for c in table.columns if c != "rank"})
    if "rank" in table.columns and table["rank"].nunique() > 1:
        return _norms_from_worker_logs(run, table)
    out: dict[str, ShardNorm] = {}
    for name, norm, numel in zip(table["name"], table["norm"], table.get("numel", [-1] * len(table)),
                                 strict=False):
        out[str(name)] = ShardNorm(-1, 1, {0: float(norm)}, {0: max(int(numel), 0)}, {0})  # 0 = size unknown
    return out, {"ranks": [0], "global_norm": None, "tables": 1, "tp": 1, "source": "log"}


def _norms_from_worker_logs(run: Any, table: Any) -> tuple[dict[str, ShardNorm], dict[str, Any]]:
    """msrun worker logs' TrainingStateMonitor norms, one set per rank: each is that rank's slice of a
    parameter's gradient before the DP all-reduce (the mirror bprop dumps it before reducing). The ranks are
    placed by the strategy of the config the logs printed (``parallel_config``), else read as DP ranks of
    whole parameters; TP / EP slices combine as sqrt(sum of squares), DP ranks stay apart (``pre_reduce``)."""
    from models.mindformers_parallel import ParallelStrategy, rank_part, strategy_from_yaml

    cfg = (run.meta or {}).get("config") or {}
    ranks = sorted(int(r) for r in table["rank"].unique())
    world = int(((run.meta or {}).get("parallel") or {}).get("world_size") or max(ranks) + 1)
    how = "config"
    why = "no parallel_config in the logs"
    try:   # meta() too: an offset of the right type that does not add up to num_layers fails in layer_stages
        strategy = strategy_from_yaml(cfg) if isinstance(cfg, dict) and cfg.get("parallel_config") else None
        par = strategy.meta() if strategy is not None else {}
    except BadInput as exc:     # as the msrun reader notes it (sources/mindformers_log.py)
        strategy, why = None, f"parallel_config in the printed config not read: {exc}"
    if strategy is not None and strategy.world != world:
        why = f"the printed parallel_config makes {strategy.world} ranks, the logs {world}"
    if strategy is None or strategy.world != world:
        strategy, how = ParallelStrategy(dp=world), f"assumed ({why}): every rank a DP rank"
        par = strategy.meta()
    out: dict[str, ShardNorm] = {}
    dropped = 0
    for rank in ranks:
        sub = table[table["rank"] == rank]
        names = [str(n) for n in sub["name"]]
        parts = [rank_part(n, (1,), strategy, rank) for n in names]
        cols: dict[str, np.ndarray] = {"name": np.asarray(names, dtype=str),
                                       "norm": sub["norm"].to_numpy(dtype=np.float64),
                                       "numel": np.full(len(names), 0, np.int64)}
        for k in ("tp_partition_dim", "tp_rank", "tp_size", "dp_rank"):
            cols[k] = np.asarray([p[k] for p in parts], dtype=np.int64)
        cols, n_drop = own_stage_rows(cols, par, rank)
        dropped += n_drop
        add_rank_table(out, cols, {"pp_rank": pipeline_stage(par, rank)}, pre_reduce=strategy.dp > 1,
                       reduce_mean=strategy.gradients_mean)
    info = {"ranks": ranks, "global_norm": None, "tables": len(ranks), "tp": strategy.tp, "source": "log",
            "parallel": par, "layout_from": how, "other_stage_rows": dropped}
    if strategy.dp > 1:
        info["grad_state"] = {PRE_ALL_REDUCE: len(ranks)}
    return out, info


def _kind_of(rule_kind: str) -> str:
    return {"output": "embedding"}.get(rule_kind, rule_kind)


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), 1e-30)


@dataclass(frozen=True)
class NormPair:
    """One compared unit: named by the baseline (the report's name), with the names on each side whose norms
    combine into it (sqrt of the sum of squares: a fused parameter's parts)."""

    name: str
    baseline: list[str]
    candidate: list[str]
    layer: int | None
    kind: str


@dataclass
class NormPairing:
    """How two runs' named norms pair through a mapping: complete pairs, groups one side lacks a part of
    ((name, missing names)), names no rule covers (per side), and the mapping as oriented to these names."""

    mapping: Any
    pairs: list[NormPair]
    incomplete: list[tuple[str, list[str]]]
    unmapped: dict[str, list[str]]


def pair_norms(b_names: Iterable[str], c_names: Iterable[str], mapping: Any) -> NormPairing:
    """Pair baseline and candidate parameter names through the mapping (oriented to the names first): the one
    name resolution every named-norm comparison uses (step-1 local norms, norm trajectories, spikes).

    Routed experts pair one by one, named by the baseline's global index, where the candidate recorded its
    stacked expert tensors in pieces (``weight1[e]``, rules.EXPERT_PIECE); where it holds only the stacked
    norm (MindFormers' own local_norm output or log) the layer's experts compare as one group, sqrt of the sum
    of squares over the baseline's experts, named as the group (``...local_experts.*.linear_fc1.weight
    (experts 0-3)``)."""
    b_names, c_names = list(b_names), list(c_names)
    m = mapping.oriented(b_names, c_names)
    groups, unmapped, _ignored = m.pair(b_names, c_names)
    pairs, incomplete = [], []
    for gp in groups:
        if not gp.complete:
            have = set(gp.baseline_present) | set(gp.candidate_present)
            miss = [n for n in gp.match.baseline + gp.match.candidate
                    if n not in {m.strip(h, s) for h in have for s in ("baseline", "candidate")}]
            incomplete.append((gp.label, miss))
            continue
        # one expert (a baseline expert against the candidate's piece NAME[e]): the baseline's name with its
        # global index; a stacked tensor compared whole: the group's name (experts 0-3), not expert 0's
        name = gp.label if gp.label != gp.name else m.strip(gp.baseline_present[0], "baseline")
        pairs.append(NormPair(name, list(gp.baseline_present),
                              list(gp.candidate_present), gp.match.layer, _kind_of(gp.match.rule.kind)))
    return NormPairing(m, pairs, incomplete, unmapped)


def compare_local_norms(baseline: Any, candidate: Any, mapping: Any = None, *, step: int = 1,
                        dtype: str = "float32", rtol: tuple[float, float] | None = None,
                        top: int = 20, repeats: Iterable[Any] = ()) -> StageResult:
    """Compare two runs' step-``step`` local norms; details name the worst parameters by baseline name.

    ``repeats``: the baseline's repeats (runs or stores); their step-``step`` norms give each parameter's
    noise floor (comparators.noise_floor), the largest over the repeats. Without one the dtype line alone
    judges, and the details say so."""
    from mapping import Mapping
    from models import load_mapping

    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    pass_tol, warn_tol = rtol or RTOL.get(dtype, RTOL["float32"])
    b_norms, b_info = read_local_norms(baseline, step)
    c_norms, c_info = read_local_norms(candidate, step)
    r_norms: list[tuple[str, dict[str, ShardNorm]]] = []
    why = "no --repeat run"
    for r in repeats:
        label = Path(str(getattr(r, "label", None) or getattr(r, "root", None) or getattr(r, "path", r))).name
        try:
            r_norms.append((label, read_local_norms(r, step)[0]))
        except BadInput as exc:    # a repeat without this step's norms: no floor from it, said in the details
            why = f"repeat {label}: {exc}"
    res = compare_norm_entries(b_norms, c_norms, m, pass_tol=pass_tol, warn_tol=warn_tol, top=top,
                               info={"baseline": b_info, "candidate": c_info, "step": step, "dtype": dtype},
                               repeats=r_norms, no_floor=None if r_norms else why)
    for side, info in (("baseline", b_info), ("candidate", c_info)):
        if PIPELINE_UNVERIFIED in info.get("grad_state", {}):
            res.add(Finding(STAGE, "warn", None, "pipeline_local_norms_unverified", None, None,
                            f"the {side}'s local norms come from MindFormers' pipeline training cell "
                            "(MFPipelineWithLossScaleCell), which computes them on GradOperation's outputs while "
                            "the micro-batch gradient sum lives in accu_grads: compared as all-reduced, not "
                            "verified (docs/layouts.md)"))
    return res


def norm_floors(pairs: list[NormPair], b_norms: dict[str, ShardNorm],
                repeats: list[tuple[str, dict[str, ShardNorm]]], no_floor: str | None = None,
                step: int | None = None) -> dict[str, nf.Floor]:
    """Each compared parameter's noise floor: the repeats' relative difference from the baseline's norm (the
    largest over the repeats), or the spread of all parameters' when larger or when the repeat lacks it."""
    own: dict[str, float | None] = {}
    for p in pairs:
        b = math.sqrt(sum(b_norms[n].full_norm() ** 2 for n in p.baseline))
        diffs = [nf.rel_diff(b, math.sqrt(sum(rn[n].full_norm() ** 2 for n in p.baseline)))
                 for _, rn in repeats if all(n in rn for n in p.baseline)]
        own[p.name] = max(diffs) if diffs else None
    what = (f"repeat {', '.join(label for label, _ in repeats)} vs baseline"
            + (f", step {step}" if step is not None else ""))
    return nf.group_floors(own, {p.name: "parameters" for p in pairs}, what, no_repeat=no_floor)


def compare_norm_entries(b_norms: dict[str, ShardNorm], c_norms: dict[str, ShardNorm], m: Any, *,
                         pass_tol: float = 1e-4, warn_tol: float = 1e-2, top: int = 20,
                         info: dict[str, Any] | None = None,
                         repeats: list[tuple[str, dict[str, ShardNorm]]] | None = None,
                         no_floor: str | None = "no --repeat run") -> StageResult:
    """The comparison proper, on already-combined per-parameter entries (kept separate for tests).
    ``repeats``: (label, entries) of the baseline's repeats, the noise floor of each parameter; ``no_floor``:
    why there is none (then the dtype line alone judges)."""
    res = StageResult(STAGE)
    info = info or {}
    for side, norms in (("baseline", b_norms), ("candidate", c_norms)):
        for name, e in norms.items():
            if e.missing_dp_parts:
                res.add(Finding(STAGE, "warn", name, "missing_dp_parts", len(e.missing_dp_parts), 0,
                                f"{side} {name}: distributed-optimizer parts of DP ranks "
                                f"{e.missing_dp_parts} of {e.dp_size} missing; its norm is partial"))
            if e.missing_shards:
                res.add(Finding(STAGE, "warn", name, "missing_tp_shards", len(e.missing_shards), 0,
                                f"{side} {name}: TP shards {e.missing_shards} of {e.tp_size} missing; "
                                "its norm is partial"))
            if e.disagree > 1e-3:
                res.add(Finding(STAGE, "warn", name, "tp_replica_disagree", e.disagree, 1e-3,
                                f"{side} {name} is duplicated across TP ranks but their gradient "
                                f"norms differ by {e.disagree:.2e}: under sequence parallelism each TP rank "
                                "holds its part of a norm / bias gradient until finalize_model_grads "
                                "all-reduces it over TP; capture after it (the grad-norm hook does)"))
            if e.replica_disagree > 1e-3:
                res.add(Finding(STAGE, "warn", name, "dp_replica_disagree", e.replica_disagree, 1e-3,
                                f"{side} {name}: its data-parallel / context-parallel replicas hold gradients "
                                f"whose norms differ by {e.replica_disagree:.2e}: not all-reduced over the "
                                "DP x CP group (captured before the reduction?); the lowest rank's is compared"))
            if len(e.pp_ranks) > 1:
                res.add(Finding(STAGE, "warn", name, "name_on_several_pp_stages", len(e.pp_ranks), 1,
                                f"{side} {name} appears on pipeline stages {sorted(e.pp_ranks)}: names must "
                                "carry global layer numbers"))
    pairing = pair_norms(b_norms, c_norms, m)
    rows = []
    for name, miss in pairing.incomplete:
        res.add(Finding(STAGE, "warn", name, "missing_counterpart", None, None,
                        f"{name}: not compared, the other run has no {', '.join(miss)}"))
    for p in pairing.pairs:
        b = math.sqrt(sum(b_norms[n].full_norm() ** 2 for n in p.baseline))
        c = math.sqrt(sum(c_norms[n].full_norm() ** 2 for n in p.candidate))
        bn = sum(b_norms[n].full_numel() for n in p.baseline)
        cn = sum(c_norms[n].full_numel() for n in p.candidate)
        row = {"name": p.name, "candidate": ",".join(p.candidate), "layer": p.layer, "kind": p.kind,
               "baseline_norm": b, "candidate_norm": c, "abs_diff": abs(b - c), "rel_diff": _rel(b, c),
               "numel_baseline": bn, "numel_candidate": cn}
        row.update(_pre_reduce_pair([b_norms[n] for n in p.baseline], [c_norms[n] for n in p.candidate], b, c))
        rows.append(row)
    for side in ("baseline", "candidate"):
        for n in pairing.unmapped[side]:
            res.add(Finding(STAGE, "warn", n, "unmapped", None, None,
                            f"{side} parameter {n} has no rule in mapping {pairing.mapping.name}; "
                            "its norm was not compared"))
    failing = 0
    bounded = [r for r in rows if r.get("compared_as") == "pre_all_reduce_bound"]
    for r in bounded:
        if r["bound_exceeded"] > warn_tol:   # beyond the fail tolerance: more than cross-framework noise
            failing += 1
            res.add(Finding(STAGE, "fail", r["name"], "local_norm_above_pre_reduce_bound", r["bound_exceeded"],
                            warn_tol, f"{r['name']}: all-reduced gradient norm {r['reduced_norm']:.6g} is above "
                            f"{r['bound']:.6g}, the sum of the other run's per-DP-rank norms before the "
                            "all-reduce: it cannot be the same gradient"))
    if bounded:
        side = bounded[0]["pre_reduce_side"]
        res.add(Finding(STAGE, "warn", None, "pre_all_reduce", len(bounded), None,
                        f"the {side}'s local norms are each DP rank's own gradient before the DP all-reduce "
                        "(MindFormers' TrainingStateMonitor local_norm, or data-parallel mode): the all-reduced "
                        "norm is not known from them. Compared: the other run's norm against their sum over DP "
                        "ranks (its upper bound, reached when the ranks' gradients point the same way) for "
                        f"{len(bounded)} parameter group(s); a norm above it by more than {warn_tol:g} fails. "
                        "To compare exactly, dump the all-reduced norms (the dumper under semi-auto parallel) "
                        "or compare with a run of the same DP size captured the same way"))
    floors = norm_floors(pairing.pairs, b_norms, repeats or [], no_floor if not repeats else None,
                         info.get("step"))
    judged = []
    # every parameter is judged at once: the floor's lines grow with their number (noise_floor.ratios)
    n_judged = sum(r.get("compared_as") != "pre_all_reduce_bound" for r in rows)
    for r in rows:
        if r.get("compared_as") == "pre_all_reduce_bound":
            continue
        if r["numel_baseline"] > 0 and r["numel_candidate"] > 0 and r["numel_baseline"] != r["numel_candidate"]:
            res.add(Finding(STAGE, "fail", r["name"], "numel", r["numel_candidate"], r["numel_baseline"],
                            f"{r['name']}: {r['numel_baseline']} elements in the baseline, "
                            f"{r['numel_candidate']} in the candidate ({r['candidate']})"))
        rel = r["rel_diff"]
        finite = math.isfinite(r["candidate_norm"]) and math.isfinite(r["baseline_norm"])
        j = nf.judge(rel if finite else math.inf, floors.get(r["name"]), (pass_tol, warn_tol), judged=n_judged)
        judged.append(j)
        r.update(j.columns(), verdict=j.verdict, threshold=j.threshold)
        if j.verdict != "pass":
            failing += 1
            res.add(Finding(STAGE, j.verdict, r["name"], "local_norm_rel_diff", rel, j.threshold,
                            f"{r['name']}: gradient norm {r['baseline_norm']:.6g} (baseline) vs "
                            f"{r['candidate_norm']:.6g} ({r['candidate']}), relative difference {rel:.3g}: "
                            f"{j.says()}"))
    rows.sort(key=lambda r: (-r["rel_diff"] if math.isfinite(r["rel_diff"]) else -math.inf))
    exact = [r for r in rows if r.get("compared_as") != "pre_all_reduce_bound"]
    if exact and failing == 0:
        worst_ratio = max((r["ratio"] for r in exact if r.get("ratio") is not None), default=None)
        res.add(Finding(STAGE, "pass", exact[0]["name"], "local_norm_rel_diff", exact[0]["rel_diff"],
                        exact[0]["threshold"],
                        f"all {len(exact)} parameter groups within {pass_tol:g} relative"
                        + (f" and within {judged[0].pass_ratio:.3g}x their noise floors (worst ratio "
                           f"{worst_ratio:.3g})" if worst_ratio is not None
                           else f" ({floors[exact[0]['name']].source})")
                        + f"; worst {exact[0]['name']} at {exact[0]['rel_diff']:.3g}; "
                        + nf.power(judged, "parameters' gradient norms")["text"]))
    res.details = {"compared": len(rows), "failing": failing, "rtol": pass_tol, **info,
                   "noise_floor": nf.summary(judged), "power": nf.power(judged, "parameters' gradient norms"),
                   "worst": rows[:top], "per_layer": _aggregate(rows, "layer"),
                   "per_kind": _aggregate(rows, "kind"),
                   "parameters": sorted(rows, key=lambda r: (r["layer"] if r["layer"] is not None else -1,
                                                             r["name"]))}
    if not rows and not res.findings:
        res.verdict = "skipped"
        res.details["reason"] = "no parameter pairs to compare"
    return res


def _pre_reduce_pair(b: list[ShardNorm], c: list[ShardNorm], b_norm: float, c_norm: float) -> dict[str, Any]:
    """How a pair with pre-all-reduce norms on a side is compared. Both sides pre-reduce over the same DP
    ranks: like with like, rank by rank (the worst rank's values). One side: the other side's all-reduced
    norm against the pre-reduce side's upper bound (``full_norm``: the DP ranks' norms summed)."""
    b_pre, c_pre = any(e.pre_reduce for e in b), any(e.pre_reduce for e in c)
    if not (b_pre or c_pre):
        return {}
    if b_pre and c_pre:
        dps = sorted(set.intersection(*[set(p) for e in b + c for p in (e.pre_reduce or {}).values()]))
        worst: dict[str, Any] = {"compared_as": "per_dp_rank", "dp_ranks": len(dps)}
        for r in dps:
            bv = math.sqrt(sum((e.dp_rank_norm(r) or 0.0) ** 2 for e in b))
            cv = math.sqrt(sum((e.dp_rank_norm(r) or 0.0) ** 2 for e in c))
            if "rel_diff" not in worst or _rel(bv, cv) > worst["rel_diff"]:
                worst.update(baseline_norm=bv, candidate_norm=cv, abs_diff=abs(bv - cv), rel_diff=_rel(bv, cv),
                             dp_rank=r)
        return worst
    bound, reduced = (b_norm, c_norm) if b_pre else (c_norm, b_norm)
    return {"compared_as": "pre_all_reduce_bound", "pre_reduce_side": "baseline" if b_pre else "candidate",
            "bound": bound, "reduced_norm": reduced,
            "bound_exceeded": max(0.0, (reduced - bound) / max(abs(bound), 1e-30))}


def _aggregate(rows: Iterable[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    acc: dict[Any, list[float]] = {}
    for r in rows:
        a = acc.setdefault(r[key], [0.0, 0.0, 0, 0.0])
        a[0] += r["baseline_norm"] ** 2
        a[1] += r["candidate_norm"] ** 2
        a[2] += 1
        a[3] = max(a[3], r["rel_diff"])
    out = []
    for k in sorted(acc, key=lambda x: (x is None, x if x is not None else 0) if key == "layer" else str(x)):
        b, c, n, worst_rel = acc[k]
        b, c = math.sqrt(b), math.sqrt(c)
        out.append({key: k, "baseline_norm": b, "candidate_norm": c, "rel_diff": _rel(b, c),
                    "max_param_rel_diff": worst_rel, "parameters": n})
    return out


def combine_tables(tables: Iterable[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> dict[str, ShardNorm]:
    """Combine in-memory local_norm tables (rank_info, columns) the same way ``read_local_norms`` does: each
    checked (runstore.check_table) and added by ``add_rank_table``, so a TP size or partition dim that two
    ranks disagree on is refused naming both, as from the files."""
    out: dict[str, ShardNorm] = {}
    for k, (rinfo, cols) in enumerate(tables):
        source = f"rank {rinfo.get('rank', k)}"
        check_table(f"{source}'s local_norm table", "local_norm", cols)
        add_rank_table(out, cols, rinfo, source=source)
    return out
