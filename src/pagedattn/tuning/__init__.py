"""The tuning table (CSV, one per device, plus a user file) and its offline tuner.

The planner asks ``lookup_grid`` for a shape's grid size, the library's only use of this
package; ``pagedattn tune`` (``tuner``) times candidates as ``pagedattn.bench`` times a step and
writes with ``upsert``. The launch configs the table feeds live in ``pagedattn.launch``. See
``table`` for the format.
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
