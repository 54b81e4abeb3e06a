"""Tuned launch parameters: the CSV tuning table and its cached lookup.

Only this package knows where the persistent decode grid size comes from; the planner asks
``lookup_grid`` and the offline tuner writes with ``upsert``. See ``table`` for the format.
"""

from pagedattn.tuning.table import (
    COLUMNS,
    DEFAULT_GRID,
    KEY_COLUMNS,
    SCHEMA_VERSION,
    TuningKey,
    TuningTableError,
    TuningTableWarning,
    bucket,
    clear_cache,
    device_slug,
    lookup_grid,
    read_table,
    shipped_table_path,
    upsert,
    user_table_path,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_GRID",
    "KEY_COLUMNS",
    "SCHEMA_VERSION",
    "TuningKey",
    "TuningTableError",
    "TuningTableWarning",
    "bucket",
    "clear_cache",
    "device_slug",
    "lookup_grid",
    "read_table",
    "shipped_table_path",
    "upsert",
    "user_table_path",
]
