"""The run store: the one format every source and dumper writes and every comparator reads.

The layer everything above stands on (docs/run-store.md). Import from here; the files inside hold one job
each: ``layout`` (folder and file names), ``atomic`` (files that appear whole), ``writer`` (one rank's
``RunWriter``), ``background`` (the ``BackgroundWriter`` thread), ``tables`` (step-file tables and their
schemas), ``reader`` (``RunReader``), ``seed_layout`` (the replayed ``step_N/rank_R/*.npy`` batches),
``step1_file`` (the step-1 optimizer file), ``run`` (a run in memory), ``schema`` (checked reading of JSON/YAML),
``batches`` (a DP rank's batch joined from its TP / PP / CP ranks), ``h5file`` / ``npzfile`` (a step file or an
``.npz`` opened only when regular, each array's declared size checked before it is read), ``rank_files`` (rank
coordinates checked, sizes agreeing across ranks).
"""

from runstore.atomic import atomic_file, atomic_write_bytes, atomic_write_json
from runstore.background import BackgroundWriter, WriterErrors
from runstore.batches import cp_join, cp_split, data_groups, dp_batches, global_batch
from runstore.layout import (
    CONVERSION_EVIDENCE,
    EVIDENCE_DIR,
    ISOLATION_EVIDENCE,
    META,
    OPTIMIZER_EVIDENCE,
    RANK_DIR,
    SCALAR_DIR,
    SCHEMA,
    SEED_BATCH_KEYS,
    STEP_DIR,
    step_dir,
)
from runstore.reader import META_SCHEMA, Incomplete, RunReader, StepArrays, read_h5
from runstore.seed_layout import load_npy, read_seed_batch, seed_steps
from runstore.step1_file import evidence_path, read_step1_file, write_step1_file
from runstore.tables import TABLE_SCHEMAS, check_table, table_columns
from runstore.writer import RunWriter

#: A run in memory (``runstore.run``) needs pandas, which a compare or a dumper does not: imported on first use
#: (``from runstore import Run`` as before), so a compare process starts ~0.3 s sooner.
_LAZY = {"Run", "make_series", "open_store", "save_run", "series_from_records"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from runstore import run

        return getattr(run, name)
    raise AttributeError(f"module 'runstore' has no attribute {name!r}")


__all__ = [
    "CONVERSION_EVIDENCE", "EVIDENCE_DIR", "ISOLATION_EVIDENCE", "META", "META_SCHEMA", "OPTIMIZER_EVIDENCE",
    "RANK_DIR", "SCALAR_DIR",
    "SCHEMA", "SEED_BATCH_KEYS", "STEP_DIR", "TABLE_SCHEMAS", "BackgroundWriter", "Incomplete", "Run",
    "RunReader", "RunWriter", "StepArrays", "WriterErrors", "atomic_file", "atomic_write_bytes",
    "atomic_write_json", "check_table", "cp_join", "cp_split", "data_groups", "dp_batches", "evidence_path",
    "global_batch", "load_npy", "make_series", "open_store", "read_h5", "read_seed_batch",
    "read_step1_file", "save_run", "seed_steps", "series_from_records", "step_dir", "table_columns",
    "write_step1_file",
]
