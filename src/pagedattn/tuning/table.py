"""The tuning table: tuned persistent-grid sizes per device and shape, stored as CSV.

File format (schema v1)
-----------------------
The first line names the schema, the second is the header, then one row per tuned key::

    # pagedattn-tuning v1
    device_name,sm_count,query_len,num_q_heads,num_kv_heads,head_dim,page_size,kv_dtype,...
    NVIDIA H200,132,1,32,8,128,16,bf16,none,64,4096,2,,41.2,47.9,0.1.0,3.3.0,2025-01-15

Columns (``COLUMNS``; order in the file is free, the header names them):

======================  ===========================================================
``device_name``         ``torch.cuda.get_device_name()``; matched case-insensitively
``sm_count``            SM (or CU) count of the device
``query_len``           new query tokens per sequence
``num_q_heads``         query heads
``num_kv_heads``        KV heads
``head_dim``            head dimension
``page_size``           tokens per KV-cache page
``kv_dtype``            ``bf16`` | ``fp16`` | ``fp8_e4m3``
``kv_scale``            ``none`` | ``per_tensor`` | ``per_token``
``batch_bucket``        ``bucket(batch size)``
``context_bucket``      ``bucket(max seq_len of the batch)``
``grid_multiplier``     the tuned value: ``num_programs = sm_count * grid_multiplier``
``partition_size``      tuned KV partition size, or empty for the planner's default
``tuned_us``            measured time with the tuned grid (empty if not measured)
``default_us``          measured time with the default grid (empty if not measured)
``pagedattn_version``   library version that tuned the row (its major.minor must match)
``triton_version``      Triton version that tuned the row (informative)
``date``                ISO date ``YYYY-MM-DD`` of the measurement
======================  ===========================================================

The first eleven columns (``KEY_COLUMNS``) form the key; a table holds at most one row per
key. A zero-byte file is an empty table. Rows are normalised on read: surrounding whitespace
and case are dropped and common spellings are mapped to the canonical ones (``bfloat16`` ->
``bf16``, ``half`` -> ``fp16``, ``float8_e4m3fn``/``e4m3``/``fp8`` -> ``fp8_e4m3``,
``per-tensor``/``tensor`` -> ``per_tensor``, empty -> ``none``, ...).

Where tables live
-----------------
One shipped table per device (``shipped_table_path``), written by the offline tuner, and a
user table (``user_table_path``) whose rows override shipped rows with the same key.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
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

__all__ = [
    "COLUMNS",
    "DEFAULT_GRID",
    "KEY_COLUMNS",
    "SCHEMA_LINE",
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

SCHEMA_VERSION = 1
SCHEMA_LINE = f"# pagedattn-tuning v{SCHEMA_VERSION}"

KEY_COLUMNS = (
    "device_name",
    "sm_count",
    "query_len",
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "page_size",
    "kv_dtype",
    "kv_scale",
    "batch_bucket",
    "context_bucket",
)
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

#: What ``lookup_grid`` returns when no table has an answer: None for both, meaning the
#: planner's own grid multiplier (it depends on the query rows per kv head) and partition size.
DEFAULT_GRID: tuple[int | None, int | None] = (None, None)

#: Directory of the shipped per-device tables (a module attribute so tests can point it away).
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"

USER_TABLE_ENV = "PAGEDATTN_TUNING_TABLE"

# Assumed when ``pagedattn.__version__`` cannot be imported (e.g. a partial checkout).
_FALLBACK_VERSION = "0.1.0"


class TuningTableError(ValueError):
    """A tuning table file that cannot be used: garbled, truncated or of another schema.

    Parameters
    ----------
    path : str
        The file.
    line : int or None
        1-based line of the problem, or None when it concerns the whole file.
    problem : str
        What is wrong, and what was expected.
    """

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        self.path = path
        self.line = line
        self.problem = problem
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"tuning table {where}: {problem}")


class TuningTableWarning(UserWarning):
    """Warned (once per file per process) when a table is broken or stale and is ignored."""


# --------------------------------------------------------------------------------------------
# Normalisation of single values. Each parser takes the text of one cell and returns the
# canonical value or raises ValueError with a message naming what was expected.
# --------------------------------------------------------------------------------------------

_DTYPE_SPELLINGS = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "f16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "fp8_e4m3",
    "fp8e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
    "e4m3fn": "fp8_e4m3",
    # The only FP8 format the kernels read; e4m3fnuz (a different bias) is deliberately absent.
    "fp8": "fp8_e4m3",
}

_SCALE_SPELLINGS = {
    "": "none",
    "none": "none",
    "per_tensor": "per_tensor",
    "pertensor": "per_tensor",
    "tensor": "per_tensor",
    "per_token": "per_token",
    "pertoken": "per_token",
    "token": "per_token",
}

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_SCHEMA_RE = re.compile(r"^#\s*pagedattn-tuning\s+v(\d+)\s*$", re.IGNORECASE)


def _spelling_key(text: str) -> str:
    text = text.strip().lower()
    text = text.removeprefix("torch.")
    return re.sub(r"[\s\-]+", "_", text)


def _parse_text(text: str) -> str:
    text = " ".join(text.split())
    if not text.isprintable():
        raise ValueError(f"expected printable text, got {text!r}")
    return text


def _parse_device_name(text: str) -> str:
    text = _parse_text(text)
    if not device_slug(text):
        raise ValueError(f"expected a device name such as 'NVIDIA H200', got {text!r}")
    return text


def _parse_positive_int(text: str) -> int:
    stripped = text.strip()
    if not stripped.isdigit() or not stripped.isascii() or int(stripped) < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return int(stripped)


def _parse_power_of_two(text: str) -> int:
    value = _parse_positive_int(text)
    if value & (value - 1):
        raise ValueError(f"expected a power of two, got {value}")
    return value


def _parse_optional_power_of_two(text: str) -> int | None:
    if text.strip().lower() in ("", "none"):
        return None
    return _parse_power_of_two(text)


def _parse_optional_time(text: str) -> float | None:
    stripped = text.strip()
    if stripped.lower() in ("", "none"):
        return None
    try:
        value = float(stripped)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a time in microseconds (>= 0) or empty, got {text!r}")
    return value


def _parse_kv_dtype(text: str) -> str:
    canonical = _DTYPE_SPELLINGS.get(_spelling_key(text))
    if canonical is None:
        raise ValueError(f"expected one of bf16, fp16, fp8_e4m3, got {text!r}")
    return canonical


def _parse_kv_scale(text: str) -> str:
    canonical = _SCALE_SPELLINGS.get(_spelling_key(text))
    if canonical is None:
        raise ValueError(f"expected one of none, per_tensor, per_token, got {text!r}")
    return canonical


def _parse_pagedattn_version(text: str) -> str:
    text = _parse_text(text)
    if not _VERSION_RE.match(text):
        raise ValueError(f"expected a version such as '0.1.0', got {text!r}")
    return text


def _parse_date(text: str) -> str:
    stripped = text.strip()
    try:
        valid = bool(_DATE_RE.match(stripped)) and bool(datetime.date.fromisoformat(stripped))
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(f"expected an ISO date YYYY-MM-DD, got {text!r}")
    return stripped


_PARSERS = {
    "device_name": _parse_device_name,
    "sm_count": _parse_positive_int,
    "query_len": _parse_positive_int,
    "num_q_heads": _parse_positive_int,
    "num_kv_heads": _parse_positive_int,
    "head_dim": _parse_positive_int,
    "page_size": _parse_positive_int,
    "kv_dtype": _parse_kv_dtype,
    "kv_scale": _parse_kv_scale,
    "batch_bucket": _parse_power_of_two,
    "context_bucket": _parse_power_of_two,
    "grid_multiplier": _parse_positive_int,
    "partition_size": _parse_optional_power_of_two,
    "tuned_us": _parse_optional_time,
    "default_us": _parse_optional_time,
    "pagedattn_version": _parse_pagedattn_version,
    "triton_version": _parse_text,
    "date": _parse_date,
}
assert tuple(_PARSERS) == COLUMNS


def _normalise_value(column: str, value: Any) -> Any:
    """Canonical value of one cell; accepts CSV text or a Python value (int, dtype, None)."""
    if value is None:
        text = ""
    elif isinstance(value, bool):
        # bool is an int subclass; True as a head count is a bug, not a 1.
        raise ValueError(f"expected {column} as text or a number, got the bool {value!r}")
    else:
        text = value if isinstance(value, str) else str(value)
    return _PARSERS[column](text)


def _format_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # shortest text that reads back as the same float
    return str(value)


def device_slug(device_name: str) -> str:
    """File-name form of a device name: lower case, runs of other characters as ``_``.

    Parameters
    ----------
    device_name : str
        For example ``"NVIDIA H200"``.

    Returns
    -------
    str
        For example ``"nvidia_h200"``. Device names are compared through their slugs.
    """
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def bucket(n: int) -> int:
    """Bucket of a batch size or context length: the smallest power of two ``>= n``.

    Parameters
    ----------
    n : int
        Batch size (number of sequences) or context length (the largest ``seq_len`` of
        the batch); at least 1.

    Returns
    -------
    int
        ``1, 2, 4, 8, ...``; for example ``bucket(1) == 1``, ``bucket(5) == 8``,
        ``bucket(8) == 8``.

    Raises
    ------
    TypeError
        If ``n`` is not an integer.
    ValueError
        If ``n < 1``.
    """
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"bucket: n must be an int, got {type(n).__name__}")
    n = n.__index__()
    if n < 1:
        raise ValueError(f"bucket: n must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class TuningKey:
    """The key of a tuning-table row: device, model shape and workload buckets.

    Fields are normalised on construction exactly as table cells are on read
    (``kv_dtype=torch.bfloat16`` becomes ``"bf16"``, ``kv_scale=None`` becomes ``"none"``),
    so two keys for the same configuration compare equal. Use ``TuningKey.from_batch`` to
    build one from a raw batch size and context length.

    Attributes
    ----------
    device_name : str
        ``torch.cuda.get_device_name()``.
    sm_count : int
        Streaming multiprocessors of the device.
    query_len, num_q_heads, num_kv_heads, head_dim, page_size : int
        The decode shape.
    kv_dtype : str
        ``"bf16"``, ``"fp16"`` or ``"fp8_e4m3"``.
    kv_scale : str
        ``"none"``, ``"per_tensor"`` or ``"per_token"``.
    batch_bucket, context_bucket : int
        ``bucket(batch size)`` and ``bucket(max seq_len)``.

    Raises
    ------
    ValueError
        If a field cannot be normalised (names the field, the expected and the given value).
    """

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
                value = _normalise_value(field.name, getattr(self, field.name))
            except ValueError as exc:
                raise ValueError(f"TuningKey.{field.name}: {exc}") from None
            object.__setattr__(self, field.name, value)

    @classmethod
    def from_batch(
        cls,
        *,
        device_name: str,
        sm_count: int,
        query_len: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        kv_dtype: Any,
        kv_scale: str | None,
        batch_size: int,
        max_seq_len: int,
    ) -> TuningKey:
        """Key for a batch of ``batch_size`` sequences whose longest has ``max_seq_len`` tokens.

        Parameters
        ----------
        device_name, sm_count, query_len, num_q_heads, num_kv_heads, head_dim, page_size
            As the fields of the same names.
        kv_dtype : str or torch.dtype
            Any accepted spelling, e.g. ``torch.float8_e4m3fn`` or ``"bf16"``.
        kv_scale : str or None
            ``None``/``"none"``, ``"per_tensor"`` or ``"per_token"``.
        batch_size : int
            Sequences in the batch (>= 1); bucketed with ``bucket``.
        max_seq_len : int
            The largest ``seq_lens[b]`` (>= 1); bucketed with ``bucket``.

        Returns
        -------
        TuningKey
        """
        return cls(
            device_name=device_name,
            sm_count=sm_count,
            query_len=query_len,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            kv_dtype=kv_dtype,
            kv_scale=kv_scale,
            batch_bucket=bucket(batch_size),
            context_bucket=bucket(max_seq_len),
        )


def _identity(row: Mapping[str, Any]) -> tuple:
    """Hashable key of a normalised row (or ``vars`` of a TuningKey); device by slug."""
    return (device_slug(row["device_name"]), *(row[c] for c in KEY_COLUMNS[1:]))


# --------------------------------------------------------------------------------------------
# Reading and writing files
# --------------------------------------------------------------------------------------------


def read_table(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and normalise a tuning table.

    Parameters
    ----------
    path : str or os.PathLike
        A CSV file in the format described in this module's docstring.

    Returns
    -------
    list of dict
        One dict per row in file order, keyed by every name in ``COLUMNS``. Values are
        canonical: ``int`` for counts, sizes and buckets; ``int`` or ``None`` for
        ``partition_size``; ``float`` or ``None`` for ``tuned_us``/``default_us``; ``str``
        for the rest. A zero-byte file gives ``[]``.

    Raises
    ------
    TuningTableError
        If the file is not a valid table: wrong or missing schema line, missing or unknown
        columns, a row with the wrong number of fields (e.g. a truncated line), a value that
        cannot be normalised, or two rows with the same key. The message names the file and
        the line.
    OSError
        If the file cannot be read (including ``FileNotFoundError``).
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        data = f.read()
    return _parse_table(name, data)


def _parse_table(name: str, data: bytes) -> list[dict[str, Any]]:
    try:
        text = data.decode("utf-8-sig")  # -sig: tolerate the BOM spreadsheets write
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TuningTableError(name, line, "not UTF-8 text (garbled file?)") from None
    if not text.strip():
        return []

    stream = io.StringIO(text, newline="")
    first = stream.readline().rstrip("\r\n")
    match = _SCHEMA_RE.match(first.strip())
    if match is None:
        raise TuningTableError(name, 1, f"first line must be {SCHEMA_LINE!r}, found {first[:60]!r}")
    if int(match.group(1)) != SCHEMA_VERSION:
        raise TuningTableError(
            name,
            1,
            f"schema v{match.group(1)} is not supported (this pagedattn reads "
            f"v{SCHEMA_VERSION}); re-run `pagedattn tune` or use a matching pagedattn",
        )

    reader = csv.reader(stream, strict=True)
    header: list[str] | None = None
    rows: list[dict[str, Any]] = []
    first_line_of: dict[tuple, int] = {}
    while True:
        # 1-based line of the next row; the reader has not seen the schema line.
        line = reader.line_num + 2
        try:
            fields_ = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise TuningTableError(name, line, f"malformed CSV ({exc})") from None
        if not fields_ or (len(fields_) == 1 and not fields_[0].strip()):
            continue  # blank line
        if header is None:
            header = _check_header(name, line, fields_)
            continue
        if len(fields_) != len(header):
            raise TuningTableError(
                name,
                line,
                f"expected {len(header)} fields, found {len(fields_)} (truncated or garbled line?)",
            )
        row = {}
        for column, cell in zip(header, fields_):
            try:
                row[column] = _PARSERS[column](cell)
            except ValueError as exc:
                raise TuningTableError(name, line, f"column {column}: {exc}") from None
        key = _identity(row)
        if key in first_line_of:
            raise TuningTableError(
                name, line, f"same key as line {first_line_of[key]} (one row per key)"
            )
        first_line_of[key] = line
        rows.append({column: row[column] for column in COLUMNS})
    if header is None:
        raise TuningTableError(name, 2, "missing header line after the schema line")
    return rows


def _check_header(name: str, line: int, cells: list[str]) -> list[str]:
    header = [cell.strip().lower() for cell in cells]
    duplicated = sorted({c for c in header if header.count(c) > 1})
    if duplicated:
        raise TuningTableError(name, line, f"duplicated column(s) {', '.join(duplicated)}")
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TuningTableError(name, line, f"missing column(s) {', '.join(missing)}")
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        shown = ", ".join(repr(c[:40]) for c in unknown[:5])
        raise TuningTableError(name, line, f"unknown column(s) {shown} (schema v{SCHEMA_VERSION})")
    return header


def _normalise_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    normalised = []
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
        row = {}
        for column in COLUMNS:
            try:
                row[column] = _normalise_value(column, raw[column])
            except ValueError as exc:
                raise ValueError(f"upsert: rows[{index}], column {column}: {exc}") from None
        normalised.append(row)
    return normalised


@contextlib.contextmanager
def _exclusive_lock(path: str):
    # Imported here so that reading and lookups still work where fcntl does not exist.
    import fcntl

    # The lock file is never deleted: a process blocked on a deleted inode would then hold a
    # "lock" that a newcomer, locking a fresh file of the same name, does not see.
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_atomically(path: str, rows: list[dict[str, Any]]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o644
    # Same directory as the target, so os.replace is a rename within one file system.
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(SCHEMA_LINE + "\n")
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(COLUMNS)
            for row in rows:
                writer.writerow([_format_value(row[c]) for c in COLUMNS])
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    # Make the rename itself durable; not every file system allows fsync on a directory.
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def upsert(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Insert or replace rows of a tuning table, atomically and safely across processes.

    Under an exclusive ``fcntl.flock`` on the sidecar file ``path + ".lock"``, the existing
    table is read, each given row replaces the row with the same key (in place) or is
    appended, and the result is written to a temporary file in the same directory, fsynced
    and renamed over ``path``. Concurrent upserts therefore serialise and lose no row, and a
    reader sees either the old or the new file, never a torn one. Missing parent directories
    are created.

    Parameters
    ----------
    path : str or os.PathLike
        The table; it need not exist yet.
    rows : iterable of mapping
        Rows keyed by exactly the names in ``COLUMNS``; values may be text or Python values
        (``int``, ``float``, ``None``, ``torch.dtype``) and are normalised as on read. Of two
        given rows with the same key, the later wins.

    Returns
    -------
    list of dict
        The whole table as written, normalised, in file order.

    Raises
    ------
    TypeError, ValueError
        If a given row is not a mapping, lacks or adds columns, or has a value that cannot
        be normalised (names the row index and the column); nothing is written.
    TuningTableError
        If the existing file is broken; it is left untouched, for a person to look at.
    OSError
        If the directory or files cannot be created or written.

    Notes
    -----
    The lookup cache of this process forgets ``path``, so later lookups see the new rows.
    Other processes keep their cached answers until they restart.
    """
    name = os.fspath(path)
    new_rows = _normalise_rows(rows)
    os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
    with _exclusive_lock(name):
        try:
            existing = read_table(name)
        except FileNotFoundError:
            existing = []
        table = {_identity(row): row for row in existing}
        for row in new_rows:
            table[_identity(row)] = row  # dicts keep first-insertion order: in-place replace
        merged = list(table.values())
        _write_atomically(name, merged)
    _forget(name)
    return merged


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def user_table_path() -> Path:
    """The user's tuning table, whose rows override the shipped ones.

    Returns
    -------
    pathlib.Path
        ``$PAGEDATTN_TUNING_TABLE`` if set and non-empty; else
        ``$XDG_CACHE_HOME/pagedattn/tuning.csv`` if ``XDG_CACHE_HOME`` is an absolute path;
        else ``~/.cache/pagedattn/tuning.csv``. The file need not exist.
    """
    explicit = os.environ.get(USER_TABLE_ENV, "")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return base / "pagedattn" / "tuning.csv"


def shipped_table_path(device_name: str) -> Path:
    """The table shipped in the package for a device (it may not exist).

    Parameters
    ----------
    device_name : str
        For example ``"NVIDIA H200"``.

    Returns
    -------
    pathlib.Path
        ``pagedattn/tuning/configs/<device_slug(device_name)>.csv``, e.g. ``nvidia_h200.csv``.
    """
    return CONFIGS_DIR / f"{device_slug(device_name)}.csv"


# --------------------------------------------------------------------------------------------
# Cached lookup
# --------------------------------------------------------------------------------------------

# Per process: usable rows of each table file, read once (absolute path -> identity -> grid).
_TABLES: dict[str, dict[tuple, tuple[int, int | None]]] = {}
# Per process: answers, keyed by (key, user table, shipped table).
_ANSWERS: dict[tuple[TuningKey, str, str], tuple[int, int | None]] = {}
# Files (or "lookup" for internal failures) already warned about in this process.
_WARNED: set[str] = set()


def clear_cache() -> None:
    """Forget every table read and answer given, and re-arm the once-per-file warnings."""
    _TABLES.clear()
    _ANSWERS.clear()
    _WARNED.clear()


def _forget(path: str) -> None:
    _TABLES.pop(os.path.abspath(path), None)
    _ANSWERS.clear()


def _warn_once(subject: str, message: str, stacklevel: int) -> None:
    if subject not in _WARNED:
        _WARNED.add(subject)
        # +1 for this frame, so the warning points at lookup_grid's caller (the planner).
        warnings.warn(message, TuningTableWarning, stacklevel=stacklevel + 1)


def _running_version() -> str:
    try:
        from pagedattn import __version__
    except Exception:  # a partial checkout or a half-initialised package
        return _FALLBACK_VERSION
    return str(__version__)


def _major_minor(version: str) -> tuple[int, int] | None:
    match = _VERSION_RE.match(version.strip())
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def _load(path: str) -> dict[tuple, tuple[int, int | None]]:
    """Usable rows of one table: {} when missing, broken (warned) or wholly stale (warned)."""
    path = os.path.abspath(path)
    cached = _TABLES.get(path)
    if cached is not None:
        return cached
    usable: dict[tuple, tuple[int, int | None]] = {}
    try:
        rows = read_table(path)
    except FileNotFoundError:
        rows = []
    except (TuningTableError, OSError) as exc:
        _warn_once(
            path,
            f"{exc}. This table is ignored and the decode grid falls back to other tables or "
            f"the planner's default grid; fix or delete the file, or re-run `pagedattn tune`.",
            stacklevel=3,
        )
        rows = []
    running = _running_version()
    current = _major_minor(running)
    stale_versions = set()
    for row in rows:
        if current is not None and _major_minor(row["pagedattn_version"]) != current:
            stale_versions.add(row["pagedattn_version"])
            continue
        usable[_identity(row)] = (row["grid_multiplier"], row["partition_size"])
    if stale_versions:
        _warn_once(
            path,
            f"tuning table {path}: {len(rows) - len(usable)} of {len(rows)} rows were tuned "
            f"with pagedattn {', '.join(sorted(stale_versions))}, but this is pagedattn "
            f"{running}; those rows are ignored and their shapes fall back to other rows or "
            f"the planner's default grid. Re-run `pagedattn tune` to refresh them.",
            stacklevel=3,
        )
    _TABLES[path] = usable
    return usable


def _log2(power_of_two: int) -> int:
    return power_of_two.bit_length() - 1


def _choose(key: TuningKey, table: Mapping[tuple, tuple[int, int | None]]):
    identity = _identity(vars(key))
    exact = table.get(identity)
    if exact is not None:
        return exact
    shape = identity[:-2]
    batch, context = _log2(key.batch_bucket), _log2(key.context_bucket)
    best_rank, best = None, DEFAULT_GRID
    for candidate, grid in table.items():
        if candidate[:-2] != shape:
            continue
        their_batch, their_context = _log2(candidate[-2]), _log2(candidate[-1])
        distance = abs(their_batch - batch) + abs(their_context - context)
        # Ties go to the larger buckets (context first, then batch): a grid tuned for more
        # work costs a few idle programs on less work, while one tuned for less work leaves
        # SMs idle on more.
        rank = (distance, -their_context, -their_batch)
        if best_rank is None or rank < best_rank:
            best_rank, best = rank, grid
    return best


def lookup_grid(key: TuningKey) -> tuple[int | None, int | None]:
    """Tuned ``(grid_multiplier, partition_size)`` for a key; never raises.

    The shipped table of the key's device and the user table are merged, user rows replacing
    shipped rows with the same key. Then:

    1. a row with exactly this key wins;
    2. else, among rows of the same device (name and SM count) and the same model shape
       (query_len, heads, head_dim, page_size, kv_dtype, kv_scale), the nearest bucket wins:
       the smallest ``|log2(batch_bucket) - log2(b)| + |log2(context_bucket) - log2(c)|``,
       ties going to the larger ``context_bucket``, then to the larger ``batch_bucket``;
    3. else ``DEFAULT_GRID`` = ``(None, None)``: the planner's own grid multiplier
       (:func:`pagedattn.launch.default_grid_multiplier`) and partition size.

    Each file is read once per process (see ``clear_cache``); a missing file counts as empty.
    A broken file is ignored and rows tuned by another pagedattn major.minor version are
    ignored, each with one ``TuningTableWarning`` per file per process.

    Parameters
    ----------
    key : TuningKey
        Device, shape and buckets of the decode step.

    Returns
    -------
    tuple of (int or None, int or None)
        ``(grid_multiplier, partition_size)``; None means "the planner's default".
    """
    try:
        user = os.path.abspath(user_table_path())
        shipped = os.path.abspath(shipped_table_path(key.device_name))
        answer = _ANSWERS.get((key, user, shipped))
        if answer is None:
            table = dict(_load(shipped))
            table.update(_load(user))
            answer = _choose(key, table)
            _ANSWERS[(key, user, shipped)] = answer
        return answer
    except Exception as exc:  # the decode path must not fail on tuning trouble
        _warn_once(
            "lookup",
            f"pagedattn tuning lookup failed ({type(exc).__name__}: {exc}); using the default "
            "grid.",
            stacklevel=2,
        )
        return DEFAULT_GRID
