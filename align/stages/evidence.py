"""What the stages read: the user's runs and files, loaded once, plus the options that judge them.

Why one object: a stage asks for evidence by meaning (the baseline's config snapshot, the candidate's
optimizer-check file, the lr=0 pair), not by path; where it comes from (a run store's meta or evidence/
folder, a log, a file named on the command line) is decided here, once, for every stage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from comparators.scalars import ScalarComparison, ScalarOptions, compare_scalars
from core.dtypes import coarsest, normalize
from core.errors import BadInput
from core.findings import StageResult
from runstore import EVIDENCE_DIR
from runstore.run import Run
from sources import detect, load_run


@dataclass
class Options:
    """Thresholds. ``layer_tolerance`` overrides the layer comparator's (pass, warn, cosine) per dtype;
    ``dtype`` overrides the precision read from the runs' metadata."""

    scalar: ScalarOptions = field(default_factory=ScalarOptions)
    layer_tolerance: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    dtype: str | None = None
    vocab_size: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    jobs: int | None = None            # parallel tensor readers (layer tensors)
    scheduler: str | None = None       # a Dask scheduler address: the layer compare fans out there
    local_norm_rtol: tuple[float, float] | None = None   # step-1 local norms (pass, warn); None: by dtype
    lr0_rtol: tuple[float, float] | None = None          # lr=0 pair loss / grad norm (pass, warn); None: by dtype


@dataclass
class Inputs:
    """Everything a user can point the procedure at (the `align report` arguments)."""

    baseline: str
    candidate: str
    repeats: list[str] = field(default_factory=list)
    lr0: tuple[str, str] | None = None
    baseline_config: str | None = None
    candidate_config: str | None = None
    optimizer_check: str | None = None
    conversion: str | None = None
    mapping: str | None = None
    rerun: str | None = None        # the candidate's re-run of its first steps (PYNATIVE, for layer capture)
    baseline_env: str | None = None     # environment captures (align capture-env); default: the runs' meta
    candidate_env: str | None = None
    isolation: str | None = None        # single-module isolation evidence (align isolate): npz or its run
    lr0_repeats: list[str] = field(default_factory=list)   # the baseline's repeat at lr = 0: lr = 0 floors per step
    options: Options = field(default_factory=Options)

    def run_paths(self) -> list[str]:
        """Every run given (baseline, candidate, repeats, the lr=0 pair, the re-run)."""
        return [self.baseline, self.candidate, *self.repeats, *(self.lr0 or ()),
                *([self.rerun] if self.rerun else [])]


def _size(path: str) -> str:
    p = Path(path)
    if p.is_file():
        n = float(p.stat().st_size)
        for unit in ("B", "KB", "MB", "GB"):
            if n < 1024 or unit == "GB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024
    return "dir"



def meta_config(meta: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(kind, values) of the config a run recorded: the dumper's snapshot in meta.json (``{"kind", "values"}``,
    or the bare dict with the framework saying which kind), else a Megatron log's own arguments block."""
    cfg = meta.get("config")
    if isinstance(cfg, dict) and isinstance(cfg.get("values"), dict) and "kind" in cfg:
        return str(cfg["kind"]), cfg["values"]
    if isinstance(cfg, dict) and cfg:
        fw = str(meta.get("framework", ""))
        return ("mindformers_yaml" if fw.startswith("mind") else "megatron_args"), cfg
    args = meta.get("arguments")
    if isinstance(args, dict) and args:
        return "megatron_args", args
    return None

def silent_against(baseline: Run, rep: Run, dtype: str = "float32") -> str | None:
    """Why the repeat ``rep`` measures no noise against ``baseline`` (comparators.noise_floor.silent_repeat),
    or None: judged on the loss and grad norm at every step the two share."""
    from comparators.noise_floor import silent_repeat

    series = []
    for key in ("loss", "grad_norm"):
        b, r = baseline.series(key), rep.series(key)
        common = b.index.intersection(r.index)
        if len(common):
            series.append((key, b.reindex(common).to_numpy(), r.reindex(common).to_numpy()))
    return silent_repeat(series, dtype)


class Evidence:
    """The loaded runs and the helpers stages use to find their evidence."""

    def __init__(self, inputs: Inputs, runs: dict[str, Run]) -> None:
        self.inputs = inputs
        self.options = inputs.options
        self.runs = runs
        self.baseline: Run = runs["baseline"]
        self.candidate: Run = runs["candidate"]
        self.lr0: tuple[Run, Run] | None = ((runs["lr0_baseline"], runs["lr0_candidate"])
                                            if "lr0_baseline" in runs else None)
        self.rerun: Run | None = runs.get("rerun")
        self.lr0_repeats: list[Run] = [r for k, r in runs.items() if k.startswith("lr0_repeat")]
        self._configs: dict[str, tuple[str, dict[str, Any]] | None] = {}
        self.environments: dict[str, dict[str, Any]] = {}   # role -> environment capture (the cluster diff)
        # A repeat that measures no noise (bit-identical to the baseline) is kept aside, named by the band
        # stage, and used for no floor and no band: the stages see only the repeats that measured noise.
        self.all_repeats: list[Run] = [r for k, r in runs.items() if k.startswith("repeat")]
        self.silent_repeats: list[tuple[Run, str]] = []
        self.repeats: list[Run] = []
        for rep in self.all_repeats:
            why = self._silent(rep)
            if why is None:
                self.repeats.append(rep)
            else:
                self.silent_repeats.append((rep, why))

    @classmethod
    def load(cls, inputs: Inputs, progress: Callable[[str], None] | None = None) -> Evidence:
        """Load every run before anything is written: bad input stops here with one line."""
        items = [("baseline", inputs.baseline), ("candidate", inputs.candidate)]
        items += [(f"repeat{i + 1}", r) for i, r in enumerate(inputs.repeats)]
        if inputs.lr0:
            items += [("lr0_baseline", inputs.lr0[0]), ("lr0_candidate", inputs.lr0[1])]
        items += [(f"lr0_repeat{i + 1}", r) for i, r in enumerate(inputs.lr0_repeats)]
        if inputs.rerun:
            items.append(("rerun", inputs.rerun))
        for extra in (inputs.baseline_config, inputs.candidate_config, inputs.optimizer_check,
                      inputs.conversion, inputs.isolation):
            if extra is not None and not Path(extra).exists():
                raise BadInput(f"{extra}: no such file or directory")
        from comparators.environment import check_capture, read_capture
        env_files = {role: read_capture(p) for role, p in (("baseline", inputs.baseline_env),
                                                           ("candidate", inputs.candidate_env)) if p is not None}
        if inputs.mapping is not None:     # a bad --mapping is bad input even where no stage needs a mapping
            from models import load_mapping
            load_mapping(inputs.mapping)
        kinds = {role: detect(p) for role, p in items}

        def one(role: str, path: str) -> tuple[Run, float]:
            t = time.perf_counter()
            return load_run(path, kinds[role]), time.perf_counter() - t

        # Readers spend most of their time in numpy and pyarrow, which let go of the GIL: runs read side by
        # side. Results are taken in order, so the first bad input named is the one a serial read would name.
        pool = ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1))
        try:
            futures = [pool.submit(one, role, path) for role, path in items]
            runs: dict[str, Run] = {}
            for (role, path), fut in zip(items, futures, strict=True):
                runs[role], took = fut.result()
                if progress:
                    progress(f"{role}: {path} ({kinds[role]}, {_size(path)}): {len(runs[role].steps)} steps in "
                             f"{took:.2f} s")
        except BaseException:
            # bad input or Ctrl-C: said now, not after the other runs' reads (a large log takes minutes)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        ev = cls(inputs, runs)
        for role in ("baseline", "candidate"):
            meta_env = runs[role].meta.get("environment")
            if role not in env_files and meta_env is not None:
                env_files[role] = check_capture(meta_env, f"{runs[role].path}/meta.json (environment)")
        ev.environments = env_files
        return ev

    def _silent(self, rep: Run) -> str | None:
        """Why ``rep`` measures no noise against the baseline (:func:`silent_against`), or None, at the
        precision the runs computed in."""
        try:
            dtype = self.dtype[0]
        except BadInput:          # an unreadable config is reported by the stages that read it
            dtype = "float32"
        return silent_against(self.baseline, rep, dtype)

    # -- evidence by meaning ------------------------------------------------------------------------------
    def evidence_file(self, run: Run, name: str) -> Path | None:
        """``RUN/evidence/<name>`` of a run store, when present."""
        if run.store is None:
            return None
        p = Path(run.path) / EVIDENCE_DIR / name
        return p if p.is_file() else None

    def environment(self, role: str) -> dict[str, Any] | None:
        """A run's environment capture: the file named on the command line, else its meta.json's."""
        return self.environments.get(role)

    def config(self, role: str) -> tuple[str, dict[str, Any]] | None:
        """(kind, values) of a run's config: the file named on the command line, else the snapshot the
        dumper recorded in meta.json (``{"kind", "values"}``, or the bare dict with the framework saying
        which kind), else a Megatron log's own arguments block. Read once per role (several stages ask)."""
        if role not in self._configs:
            self._configs[role] = self._read_config(role)
        return self._configs[role]

    def config_base(self, role: str) -> list[Path]:
        """The folders relative paths inside a run's config resolve against (a MindFormers YAML's data_dir):
        the config file's folder when named on the command line, else the run store (or the log's folder)
        that recorded it, then the folders above; never the working folder."""
        from align.checks.config import config_bases

        path = self.inputs.baseline_config if role == "baseline" else self.inputs.candidate_config
        if path is not None:
            return config_bases(path, is_file=True)
        run = self.baseline if role == "baseline" else self.candidate
        return config_bases(run.path, is_file=not Path(run.path).is_dir())

    def _read_config(self, role: str) -> tuple[str, dict[str, Any]] | None:
        from sources.configs import read_megatron, read_mindformers

        path = self.inputs.baseline_config if role == "baseline" else self.inputs.candidate_config
        if path is not None:
            if Path(path).is_dir():
                raise BadInput(f"{path}: is a directory, expected the {role}'s config file (--{role}-config: "
                               "Megatron arguments, a launch script or log, or a MindFormers YAML)")
            text_kind = "mindformers_yaml" if Path(path).suffix in (".yaml", ".yml") else "megatron_args"
            if text_kind == "mindformers_yaml":
                return text_kind, read_mindformers(path)
            return text_kind, read_megatron(path)[0]
        return meta_config((self.baseline if role == "baseline" else self.candidate).meta)

    @cached_property
    def update_dtype(self) -> tuple[str, str]:
        """(dtype, where it came from) of the optimizer update: the coarsest parameter / gradient / compute
        precision either run recorded (the optimizer check steps on the baseline's gradients, so attention's
        precision does not enter); float32 when neither run recorded one (and the stages say so)."""
        if self.options.dtype:
            return normalize(self.options.dtype), "--dtype"
        found = self._recorded(("compute", "params", "grads"))
        if found:
            return coarsest(found), "recorded in the runs' meta.json (dtypes)"
        return "float32", "not recorded by either run: assumed float32"

    @cached_property
    def dtype(self) -> tuple[str, str]:
        """(dtype, where it came from) of what forward and backward produce (losses, local norms): the
        update precision, or the attention's when coarser: recorded in meta (``dtypes.attention``), or the
        float16 a MindFormers 2.x candidate's flash attention computes a float32 run in."""
        from align.checks.config import mindformers_attention_dtype

        if self.options.dtype:
            return normalize(self.options.dtype), "--dtype"
        attention = self._recorded(("attention",))
        source = "recorded in the runs' meta.json (dtypes.attention)"
        cfg = self.config("candidate")
        from_config = mindformers_attention_dtype(cfg[1]) if cfg and cfg[0] == "mindformers_yaml" else None
        if not attention and from_config:
            attention = [from_config]
            source = (f"the candidate's MindFormers config: its flash attention computes in {from_config} "
                      "(use_flash_attention with compute_dtype float32)")
        update = self.update_dtype
        if attention and coarsest([update[0], *attention]) != update[0]:
            return coarsest(attention), source
        return update

    def _recorded(self, keys: tuple[str, ...]) -> list[str]:
        found = []
        for run in (self.baseline, self.candidate):
            d = run.meta.get("dtypes")
            if isinstance(d, dict):
                found += [normalize(str(d[k])) for k in keys if d.get(k)]
        return found

    @property
    def mapping(self) -> str:
        """The mapping preset or file: ``--mapping``, else the one the candidate's config needs (a MindFormers
        2.x mcore YAML: the mcore dense / MoE / MLA / MLA-qkv-concat preset), else Megatron-core <->
        MindFormers Llama."""
        return self._mapping[0]

    @cached_property
    def _mapping(self) -> tuple[str, str]:
        from models import DEFAULT_PRESET, preset_for_config, preset_for_names, preset_for_scheme

        if self.inputs.mapping:
            return self.inputs.mapping, "--mapping"
        cfg = self.config("candidate")
        preset = preset_for_config(cfg[1]) if cfg and cfg[0] == "mindformers_yaml" else None
        if preset:
            return preset, "the candidate's MindFormers 2.x config"
        scheme = self.candidate.meta.get("name_scheme")
        preset = preset_for_scheme(scheme)
        if preset:
            return preset, f"the candidate's name scheme ({scheme})"
        if _megatron(self.baseline) and _megatron(self.candidate):
            # two Megatron runs (another TP/DP layout, a repeat): the preset whose Megatron side covers both
            # runs' parameter names (MoE routers and experts, MLA), compared Megatron to Megatron (mirrored)
            preset = preset_for_names((_norm_names(self.baseline), "baseline"),
                                      (_norm_names(self.candidate), "baseline"))
            if preset:
                return preset, "both runs are Megatron: the preset covering their parameter names"
        return DEFAULT_PRESET, "default"

    @property
    def mapping_source(self) -> str:
        return self._mapping[1]

    @cached_property
    def rerun_check(self) -> StageResult | None:
        """The candidate against its re-run (computed once: its stage reports it, the layer stage heeds it)."""
        if self.rerun is None:
            return None
        from comparators.rerun import compare_rerun
        return compare_rerun(self.candidate, self.rerun, dtype=self.dtype[0])

    def norm_trajectory(self, role: str) -> Any:
        """The baseline's or candidate's named gradient norms at every recorded step (comparators.trajectories),
        read once: the self-check and the trajectory stage both use them. None: the run holds none."""
        cache = self.__dict__.setdefault("_trajectories", {})
        if role not in cache:
            from comparators.trajectories import norm_groups, read_trajectory
            run = self.baseline if role == "baseline" else self.candidate
            cache[role] = (read_trajectory(run, "local_norm", jobs=self.options.jobs or os.cpu_count() or 1)
                           if "local_norm" in norm_groups(run) else None)
        return cache[role]

    @cached_property
    def evidence_totals(self) -> dict[str, Any]:
        """Each side's self-check (comparators.evidence_totals: its named norms recombined against its own global
        norm), computed once: its stage reports it, the stages resting on named norms heed it."""
        from comparators.evidence_totals import check_side
        return {role: check_side(self.baseline if role == "baseline" else self.candidate, role,
                                 trajectory=self.norm_trajectory(role)) for role in ("baseline", "candidate")}

    @cached_property
    def scalars(self) -> ScalarComparison:
        return compare_scalars(self.baseline, self.candidate, self.repeats, self.options.scalar, self.dtype[0])

    def transform_params(self) -> Any:
        """Heads and query groups for fused-QKV transforms, and the routed experts for stacked-expert ones,
        from the baseline's config when known."""
        from mapping import TransformParams

        cfg = self.config("baseline")
        vals = cfg[1] if cfg else {}
        heads = vals.get("num_attention_heads")
        groups = vals.get("num_query_groups") if vals.get("group_query_attention", True) else heads
        if not isinstance(heads, int):
            return None
        experts = vals.get("num_experts")
        return TransformParams(num_heads=heads, num_query_groups=groups if isinstance(groups, int) else heads,
                               num_experts=experts if isinstance(experts, int) and experts > 0 else None)


def _megatron(run: Run) -> bool:
    """A run in Megatron's own names (a Megatron store or log)."""
    return str(run.meta.get("name_scheme") or "").startswith("megatron")


def _norm_names(run: Run) -> list[str]:
    """The parameter names of a run's first step with named local norms (none: an empty list)."""
    steps = run.local_norm_steps(limit=1)
    table = run.local_norm_table(steps[0]) if steps else None
    return [str(n) for n in table["name"].unique()] if table is not None and "name" in table else []
