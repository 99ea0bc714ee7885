"""The run store: the one format every source and dumper writes and every comparator reads.

The layer everything above stands on (docs/run-store.md). Import from here; the files inside hold one job
each (``store``: the on-disk format, ``run``: a run in memory, ``schema``: checked reading of JSON/YAML).
"""

from runstore.run import Run, make_series, open_store, save_run, series_from_records
from runstore.store import (
    CONVERSION_EVIDENCE,
    EVIDENCE_DIR,
    META,
    META_SCHEMA,
    OPTIMIZER_EVIDENCE,
    RANK_DIR,
    SCALAR_DIR,
    SCHEMA,
    SEED_BATCH_KEYS,
    STEP_DIR,
    TABLE_SCHEMAS,
    BackgroundWriter,
    Incomplete,
    RunReader,
    RunWriter,
    StepArrays,
    WriterErrors,
    atomic_file,
    atomic_write_bytes,
    atomic_write_json,
    check_table,
    load_npy,
    read_h5,
    read_seed_batch,
    read_step1_file,
    seed_steps,
    step_dir,
    table_columns,
    write_step1_file,
)

__all__ = [
    "CONVERSION_EVIDENCE", "EVIDENCE_DIR", "META", "META_SCHEMA", "OPTIMIZER_EVIDENCE", "RANK_DIR", "SCALAR_DIR",
    "SCHEMA", "SEED_BATCH_KEYS", "STEP_DIR", "TABLE_SCHEMAS", "BackgroundWriter", "Incomplete", "Run",
    "RunReader", "RunWriter", "StepArrays", "WriterErrors", "atomic_file", "atomic_write_bytes",
    "atomic_write_json", "check_table", "load_npy", "make_series", "open_store", "read_h5", "read_seed_batch",
    "read_step1_file", "save_run", "seed_steps", "series_from_records", "step_dir", "table_columns",
    "write_step1_file",
]
