"""Shared test setup: device selection, seeds, error measure.

Without a GPU the kernels run through Triton's interpreter on CPU tensors; that switch must be
made before Triton is imported, hence here.
"""

import os
import subprocess
import sys
import types
import zlib
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

requires_gpu = pytest.mark.skipif(
    not ON_GPU, reason="needs a CUDA GPU (CPU run uses the interpreter)"
)


@pytest.fixture(autouse=True)
def fresh_call_signatures(monkeypatch):
    """Each test starts with no prepared launches, so a test that patches a kernel or a choice
    sees calls take the full path; within a test the fast path works as in use."""
    import pagedattn.cache
    import pagedattn.decode
    import pagedattn.plan

    monkeypatch.setattr(pagedattn.plan, "_PLAN_STEPS", {})
    monkeypatch.setattr(pagedattn.plan, "_BOUND_PLANS", {})
    monkeypatch.setattr(pagedattn.decode, "_DECODE_STEPS", {})
    monkeypatch.setattr(pagedattn.decode, "_BOUND_STEPS", {})
    monkeypatch.setattr(pagedattn.cache, "_APPEND_STEPS", {})
    monkeypatch.setattr(pagedattn.cache, "_BOUND_APPENDS", {})


@pytest.fixture
def gen(request):
    """A generator seeded from the test's id: fresh data per case, reproducible per run."""
    g = torch.Generator(device=DEVICE)
    nodeid = request.node.nodeid
    backend = getattr(request.node, "callspec", None) and request.node.callspec.params.get(
        "each_backend"
    )
    if backend:  # both kernel families see the same data
        nodeid = nodeid.replace(f"[{backend}-", "[").replace(f"[{backend}]", "")
    g.manual_seed(zlib.crc32(nodeid.encode()))
    return g


@pytest.fixture(params=["triton", "gluon"] if ON_GPU else ["triton"])
def each_backend(request):
    """Runs a test once per kernel family: on a GPU with the portable family, then with the
    Hopper family wherever it covers the call; through the interpreter once (only the
    portable family runs there). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("each_backend")``."""
    from pagedattn.backend import using_backend

    with using_backend(request.param):
        yield request.param


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core through the interpreter; on a GPU, which the workers
    share (memory, compile cache), at most four."""
    cores = os.cpu_count() or 1
    return min(cores, 4) if ON_GPU else cores


@pytest.fixture
def tuning_tables(tmp_path, monkeypatch):
    """The user table, the shipped tables' folder and the lookup cache, private to the test:
    ``.user`` (not yet written), ``.shipped`` (the H200's, not yet written), ``.tmp``."""
    from pagedattn import tuning
    from pagedattn.tuning import table

    configs = tmp_path / "configs"
    configs.mkdir()
    user = tmp_path / "user" / "tuning.csv"
    monkeypatch.setenv("PAGEDATTN_TUNING_TABLE", str(user))
    monkeypatch.setattr(table, "CONFIGS_DIR", configs)
    tuning.clear_cache()
    yield types.SimpleNamespace(user=user, shipped=configs / "nvidia_h200.csv", tmp=tmp_path)
    tuning.clear_cache()


def run_compiled(code: str, *args: str) -> str:
    """Runs ``code`` in a fresh Python with Triton's interpreter off (builds of the kernels for
    a GPU target, on any machine) and this checkout's ``pagedattn`` on its path; returns its
    stdout, failing the test with its stderr if it fails."""
    import pagedattn

    env = dict(os.environ, TRITON_INTERPRET="0")
    src = str(Path(pagedattn.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout
