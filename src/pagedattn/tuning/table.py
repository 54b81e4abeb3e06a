"""The tuning table: tuned persistent-grid sizes per device and shape, stored as CSV.

A file is a schema line, a header, then one row per key::

    # pagedattn-tuning v1
    device_name,sm_count,query_len,num_q_heads,num_kv_heads,head_dim,page_size,kv_dtype,...
    NVIDIA H200,132,1,16,1,128,1024,fp8_e4m3,per_tensor,1,1024,4,,8.621,8.621,0.1.0,3.6.0,2026-11-30

The first eleven columns (``KEY_COLUMNS``) are the key: the device
(``torch.cuda.get_device_name()``, compared through :func:`device_slug`) and its SM count, the
step's shape (``kv_dtype``: ``bf16``, ``fp16``, ``fp8_e4m3`` or ``fp8_e4m3fnuz``; ``kv_scale``:
``none``, ``per_tensor`` or ``per_token``) and the workload's buckets (:func:`bucket` of the batch
size and of the longest sequence). Then the tuned ``grid_multiplier`` (``num_programs = sm_count *
grid_multiplier``) and ``partition_size`` (empty: the planner's), the measured ``tuned_us`` and
``default_us``, and the provenance: ``pagedattn_version`` (its major.minor must match the
library's), ``triton_version`` and ``date`` (ISO). Columns may come in any order; cells are read
without surrounding white space or case, and torch dtype names are taken for ``kv_dtype``.

One table per device ships in the package (:func:`shipped_table_path`); the user's table
(:func:`user_table_path`) overrides its rows key by key. The planner asks :func:`lookup_grid`,
the offline tuner writes with :func:`upsert`.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import functools
import io
import math
import os
import re
import stat
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_LINE = f"# pagedattn-tuning v{SCHEMA_VERSION}"


@dataclass(frozen=True)
class TuningKey:
    """The key of a row: device, step shape and workload buckets, normalised on construction
    as cells are on read (``kv_dtype=torch.bfloat16`` becomes ``"bf16"``, ``kv_scale=None``
    ``"none"``); ValueError naming the field if one cannot be."""

    device_name: str
    sm_count: int
    query_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: str
    kv_scale: str
    batch_bucket: int
    context_bucket: int

    def __post_init__(self) -> None:
        for field in fields(self):
            try:
                value = _value(field.name, getattr(self, field.name))
            except ValueError as exc:
                raise ValueError(f"TuningKey.{field.name}: {exc}") from None
            object.__setattr__(self, field.name, value)

    @classmethod
    def from_batch(cls, *, batch_size: int, max_seq_len: int, **shape: Any) -> TuningKey:
        """The key of a batch of ``batch_size`` sequences whose longest has ``max_seq_len``
        tokens; ``shape`` gives the other fields (``kv_dtype`` may be a torch dtype)."""
        return cls(**shape, batch_bucket=bucket(batch_size), context_bucket=bucket(max_seq_len))


KEY_COLUMNS = tuple(field.name for field in fields(TuningKey))
COLUMNS = (
    *KEY_COLUMNS,
    "grid_multiplier",
    "partition_size",
    "tuned_us",
    "default_us",
    "pagedattn_version",
    "triton_version",
    "date",
)
#: What ``lookup_grid`` returns when no row applies: the planner's own grid and partition.
DEFAULT_GRID: tuple[int | None, int | None] = (None, None)
#: Folder of the shipped per-device tables (a module attribute, so tests can point it away).
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
USER_TABLE_ENV = "PAGEDATTN_TUNING_TABLE"

_POWERS_OF_TWO = {"batch_bucket", "context_bucket", "partition_size"}
_COUNTS = {*KEY_COLUMNS[1:7], *_POWERS_OF_TWO, "grid_multiplier"}
_TIMES = {"tuned_us", "default_us"}
_CHOICES = {
    "kv_dtype": ("bf16", "fp16", "fp8_e4m3", "fp8_e4m3fnuz"),
    "kv_scale": ("none", "per_tensor", "per_token"),
}
# torch dtype names (what the planner passes), and None for "no scales".
_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "": "none",
}
_VERSION = re.compile(r"(\d+)\.(\d+)")
_DATE = re.compile(r"\d{4}-\d\d-\d\d")
_SCHEMA = re.compile(r"#\s*pagedattn-tuning\s+v(\d+)", re.IGNORECASE)


class TuningTableError(ValueError):
    """A table file that cannot be used (garbled, truncated, another schema); names the file
    and, where it concerns one, the 1-based line."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"tuning table {where}: {problem}")


class TuningTableWarning(UserWarning):
    """A broken or stale table is ignored (warned once per file per process)."""


def _value(column: str, value: Any) -> Any:
    """The canonical value of one cell, from CSV text or a Python value (int, torch dtype,
    None); ValueError saying what was expected."""
    if isinstance(value, bool):  # an int subclass: True as a head count is a bug, not a 1
        raise ValueError(f"expected text or a number, got the bool {value!r}")
    text = "" if value is None else " ".join(str(value).split())
    if column in _CHOICES:
        name = text.lower().removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name not in _CHOICES[column]:
            raise ValueError(f"expected one of {', '.join(_CHOICES[column])}, got {text!r}")
        return name
    if column in ("partition_size", *_TIMES) and text.lower() in ("", "none"):
        return None
    if column in _TIMES:
        try:
            us = float(text)
        except ValueError:
            us = math.nan
        if not (math.isfinite(us) and us >= 0):
            raise ValueError(f"expected a time in microseconds (>= 0) or empty, got {text!r}")
        return us
    if column in _COUNTS:
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise ValueError(f"expected a positive integer, got {text!r}")
        if column in _POWERS_OF_TWO and int(text) & (int(text) - 1):
            raise ValueError(f"expected a power of two, got {int(text)}")
        return int(text)
    if not text.isprintable():
        raise ValueError(f"expected printable text, got {text!r}")
    if column == "device_name" and not device_slug(text):
        raise ValueError(f"expected a device name such as 'NVIDIA H200', got {text!r}")
    if column == "pagedattn_version" and not _VERSION.match(text):
        raise ValueError(f"expected a version such as '0.1.0', got {text!r}")
    if column == "date":
        try:
            valid = bool(_DATE.fullmatch(text) and datetime.date.fromisoformat(text))
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"expected an ISO date YYYY-MM-DD, got {text!r}")
    return text


def _row(cells: Mapping[str, Any]) -> dict[str, Any]:
    """A row of every column in ``COLUMNS`` order, normalised; ValueError naming the column."""
    row = {}
    for column in COLUMNS:
        try:
            row[column] = _value(column, cells[column])
        except ValueError as exc:
            raise ValueError(f"column {column}: {exc}") from None
    return row


def _identity(row: Mapping[str, Any]) -> tuple:
    """Hashable key of a normalised row (or ``vars`` of a TuningKey); the device by slug."""
    return (device_slug(row["device_name"]), *(row[c] for c in KEY_COLUMNS[1:]))


def device_slug(device_name: str) -> str:
    """File-name form of a device name, by which names are compared: lower case, runs of other
    characters as ``_`` (``"NVIDIA H200"`` -> ``"nvidia_h200"``)."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def bucket(n: int) -> int:
    """The bucket of a batch size or context length: the smallest power of two ``>= n >= 1``."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"bucket: n must be an int, got {type(n).__name__}")
    n = n.__index__()
    if n < 1:
        raise ValueError(f"bucket: n must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def read_table(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a table file in file order, each a dict of every column in ``COLUMNS``
    (ints, None or floats for the empty-able cells, text); a zero-byte file gives ``[]``.

    Raises TuningTableError naming the file and line if the file is not a table (schema line,
    header, a row's field count or values, two rows with one key), OSError if it cannot be
    read (FileNotFoundError included).
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")  # -sig: the byte-order mark spreadsheets write
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TuningTableError(name, line, "not UTF-8 text (garbled file?)") from None
    if not text.strip():
        return []
    first, _, body = text.partition("\n")
    schema = _SCHEMA.fullmatch(first.strip())
    if schema is None:
        found = first.rstrip("\r")[:60]
        raise TuningTableError(name, 1, f"first line must be {SCHEMA_LINE!r}, found {found!r}")
    if int(schema[1]) != SCHEMA_VERSION:
        raise TuningTableError(
            name,
            1,
            f"schema v{schema[1]} is not supported (this pagedattn reads v{SCHEMA_VERSION}); "
            "re-run `pagedattn tune` or use a matching pagedattn",
        )
    reader = csv.reader(io.StringIO(body, newline=""), strict=True)
    header: list[str] | None = None
    rows: list[dict[str, Any]] = []
    line_of: dict[tuple, int] = {}
    while True:
        line = reader.line_num + 2  # the next row's first line (the schema line is line 1)
        try:
            cells = next(reader, None)
        except csv.Error as exc:
            raise TuningTableError(name, line, f"malformed CSV ({exc})") from None
        if cells is None:
            break
        if len(cells) <= 1 and not "".join(cells).strip():
            continue  # a blank line
        if header is None:
            header = [cell.strip().lower() for cell in cells]
            missing = [c for c in COLUMNS if c not in header]
            unknown = ", ".join(repr(c[:40]) for c in header if c not in COLUMNS)
            if missing or unknown or len(header) != len(COLUMNS):
                problem = f"missing column(s) {', '.join(missing)}" if missing else ""
                problem = problem or (unknown and f"unknown column(s) {unknown}")
                raise TuningTableError(name, line, problem or "duplicated column(s)")
            continue
        if len(cells) != len(header):
            problem = f"expected {len(header)} fields, found {len(cells)} (truncated line?)"
            raise TuningTableError(name, line, problem)
        try:
            row = _row(dict(zip(header, cells)))
        except ValueError as exc:
            raise TuningTableError(name, line, str(exc)) from None
        key = _identity(row)
        if key in line_of:
            raise TuningTableError(name, line, f"same key as line {line_of[key]} (one row per key)")
        line_of[key] = line
        rows.append(row)
    if header is None:
        raise TuningTableError(name, 2, "missing header line after the schema line")
    return rows


@contextlib.contextmanager
def _locked(path: str):
    import fcntl  # here, so that reading and lookups work where fcntl does not exist

    # The lock file is never deleted: a process blocked on a deleted inode would hold a "lock"
    # that a newcomer, locking a fresh file of the same name, does not see.
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """Writes a temporary file in the same folder, fsyncs it and renames it over ``path``."""
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o644
    fd, temp = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path)
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(SCHEMA_LINE + "\n")
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(COLUMNS)
            for row in rows:
                # repr: the shortest text that reads back as the same float
                cells = (row[c] for c in COLUMNS)
                writer.writerow(
                    ["" if v is None else repr(v) if isinstance(v, float) else v for v in cells]
                )
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def upsert(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Inserts or replaces rows of a table, atomically and safely across processes; returns the
    whole table as written.

    Under an exclusive lock on ``path + ".lock"``, the table is read, each row replaces the one
    with its key (in place) or is appended (of two given rows with one key the later wins), and
    the result is written to a temporary file, fsynced and renamed over ``path``: concurrent
    upserts lose nothing and readers never see a torn file. ``rows`` have exactly the columns
    ``COLUMNS``, as text or Python values. Raises TypeError or ValueError for a bad given row
    and TuningTableError for a broken existing file, writing nothing. Lookups of this process
    see the new rows.
    """
    name = os.path.abspath(os.fspath(path))
    new_rows = []
    for index, raw in enumerate(rows):
        if not isinstance(raw, Mapping):
            raise TypeError(f"upsert: rows[{index}] must be a dict, got {type(raw).__name__}")
        missing = [c for c in COLUMNS if c not in raw]
        unknown = [c for c in raw if c not in COLUMNS]
        if missing or unknown:
            raise ValueError(
                f"upsert: rows[{index}] must have exactly the columns of schema "
                f"v{SCHEMA_VERSION}; missing {missing}, unknown {unknown}"
            )
        try:
            new_rows.append(_row(raw))
        except ValueError as exc:
            raise ValueError(f"upsert: rows[{index}], {exc}") from None
    os.makedirs(os.path.dirname(name), exist_ok=True)
    with _locked(name):
        try:
            table = {_identity(row): row for row in read_table(name)}
        except FileNotFoundError:
            table = {}
        table.update((_identity(row), row) for row in new_rows)  # dicts keep first places
        _write(name, table.values())
    clear_cache()
    return list(table.values())


def user_table_path() -> Path:
    """The user's table (it need not exist): ``$PAGEDATTN_TUNING_TABLE`` if set, else
    ``$XDG_CACHE_HOME/pagedattn/tuning.csv`` if that is absolute, else
    ``~/.cache/pagedattn/tuning.csv``."""
    explicit = os.environ.get(USER_TABLE_ENV, "")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return base / "pagedattn" / "tuning.csv"


def shipped_table_path(device_name: str) -> Path:
    """The table shipped for a device (it need not exist):
    ``pagedattn/tuning/configs/<device_slug(device_name)>.csv``."""
    return CONFIGS_DIR / f"{device_slug(device_name)}.csv"


def _running_version() -> str:
    from .._version import __version__

    return __version__


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = _VERSION.match(version).groups()
    return int(major), int(minor)


def _warn(message: str) -> None:
    # Above this frame: _usable, _answer, lookup_grid, then the planner that asked.
    warnings.warn(message, TuningTableWarning, stacklevel=5)


@functools.cache
def _usable(path: str) -> dict[tuple, tuple[int, int | None]]:
    """The grids of one file's rows tuned by this major.minor version, read once; a missing
    file has none, a broken one none and a warning, stale rows are dropped with a warning."""
    try:
        rows = read_table(path)
    except FileNotFoundError:
        rows = []
    except (TuningTableError, OSError) as exc:
        _warn(
            f"{exc}. This table is ignored and the decode grid falls back to other tables or "
            "the planner's default grid; fix or delete the file, or re-run `pagedattn tune`."
        )
        rows = []
    running = _running_version()
    fresh = [r for r in rows if _major_minor(r["pagedattn_version"]) == _major_minor(running)]
    if len(fresh) < len(rows):
        stale = sorted(
            {r["pagedattn_version"] for r in rows} - {r["pagedattn_version"] for r in fresh}
        )
        _warn(
            f"tuning table {path}: {len(rows) - len(fresh)} of {len(rows)} rows were tuned "
            f"with pagedattn {', '.join(stale)}, but this is pagedattn {running}; those rows "
            "are ignored and their shapes fall back to other rows or the planner's default "
            "grid. Re-run `pagedattn tune` to refresh them."
        )
    return {_identity(r): (r["grid_multiplier"], r["partition_size"]) for r in fresh}


@functools.cache
def _answer(key: TuningKey, user: str, shipped: str) -> tuple[int | None, int | None]:
    table = {**_usable(shipped), **_usable(user)}  # the user's rows win
    identity = _identity(vars(key))
    if identity in table:
        return table[identity]
    best_rank, best = None, DEFAULT_GRID
    for candidate, grid in table.items():
        if candidate[:-2] != identity[:-2]:
            continue
        their_batch, their_context = candidate[-2].bit_length(), candidate[-1].bit_length()
        distance = abs(their_batch - key.batch_bucket.bit_length())
        distance += abs(their_context - key.context_bucket.bit_length())
        # Ties go to the larger buckets (context first, then batch): a grid tuned for more
        # work costs a few idle programs on less work, one tuned for less leaves SMs idle.
        rank = (distance, -their_context, -their_batch)
        if best_rank is None or rank < best_rank:
            best_rank, best = rank, grid
    return best


# Bumped by ``clear_cache``: callers that keep choices made from the tables (the planner's
# prepared launches) key them on it.
_generation = 0


def cache_generation() -> int:
    """How many times the tables' cache has been cleared (``clear_cache``, ``upsert``)."""
    return _generation


def clear_cache() -> None:
    """Forget the tables read and the answers given (and so re-arm the warnings)."""
    global _generation
    _generation += 1
    _usable.cache_clear()
    _answer.cache_clear()


def lookup_grid(key: TuningKey) -> tuple[int | None, int | None]:
    """Tuned ``(grid_multiplier, partition_size)`` for a key, None for the planner's default;
    never raises.

    Over the key's shipped table and the user table (whose rows replace shipped ones with the
    same key): the row with this key; else, among rows of the same device and shape, the
    nearest buckets (smallest ``|log2 Δbatch| + |log2 Δcontext|``, ties to the larger context,
    then the larger batch); else ``DEFAULT_GRID``. Each file is read once per process (see
    ``clear_cache``); a broken file, and rows of another major.minor version, are ignored
    with one ``TuningTableWarning`` per file.
    """
    try:
        user = os.path.abspath(user_table_path())
        return _answer(key, user, os.path.abspath(shipped_table_path(key.device_name)))
    except Exception as exc:  # the decode path must not fail on tuning trouble
        warnings.warn(
            f"pagedattn tuning lookup failed ({type(exc).__name__}: {exc}); using the default "
            "grid.",
            TuningTableWarning,
            stacklevel=2,
        )
        return DEFAULT_GRID
