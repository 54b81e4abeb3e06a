"""Launch configurations per target (NVIDIA unchanged, AMD wave64 configs that fit the LDS), and
builds of the portable kernels for AMD (gfx942) and of the e4m3fnuz path for sm_90a, on the
CPU with Triton's own backends. Nothing here runs on AMD hardware."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import run_compiled

import pagedattn
from pagedattn import launch
from pagedattn.launch import (
    AMD_SHARED_BYTES,
    Target,
    decode_launch_config,
    device_target,
    reduce_launch_config,
    schedule_launch,
    target_warps,
)

FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz
GFX942 = Target("hip", "gfx942")
GFX950 = Target("hip", "gfx950")
SHAPES = [
    dict(head_dim=d, rows=r, kv_dtype=t, partition_size=256, kv_scale=s)
    for d in (64, 128, 256)
    for r in (1, 8, 16, 32, 64, 128)
    for t, s in ((FP8, "per_tensor"), (FP8, "per_token"), (torch.bfloat16, None))
]


def test_targets():
    assert Target() == Target("cuda", "") and not Target().amd and Target().warp_size == 32
    assert GFX942.amd and GFX942.warp_size == 64 and GFX942.fnuz_type
    assert (GFX942.shared_bytes, GFX950.shared_bytes) == (64 * 1024, 160 * 1024)
    assert Target("cuda", "sm_90").shared_bytes is None
    assert device_target(torch.device("cpu")) == Target()  # the interpreter: NVIDIA's configs


def test_device_target_reads_rocm_arch_names(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    props = types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert device_target.__wrapped__(torch.device("cuda", 0)) == GFX942
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert device_target.__wrapped__(torch.device("cuda", 0)) == Target("cuda", "sm_90")


@pytest.mark.parametrize("target", [None, Target(), Target("cuda", "sm_90")])
def test_nvidia_configs_unchanged_by_the_target(target):
    for shape in SHAPES:
        assert decode_launch_config(**shape, target=target) == decode_launch_config(**shape)
    for rows, records in ((8, 1), (8, 500), (64, 1), (64, 500)):
        red = dict(rows=rows, head_dim=128, records=records, sm_count=132)
        assert reduce_launch_config(**red, target=target) == reduce_launch_config(**red)
    for batch in (8, 256, 2048, 8192):
        sched = dict(batch=batch, num_programs=528, num_kv_heads=8, sm_count=132)
        assert schedule_launch(None, **sched, target=target) == schedule_launch(None, **sched)


@pytest.mark.parametrize("target", [GFX942, GFX950])
def test_amd_decode_config(target):
    for shape in [*SHAPES, *(dict(s, kv_dtype=FNUZ) for s in SHAPES if s["kv_scale"])]:
        config = decode_launch_config(**shape, target=target)
        # 64 tokens, but K tiles of at most 16 KB (16-bit caches at head_dim 256: 32 tokens).
        block_n = 32 if shape["head_dim"] == 256 and shape["kv_dtype"].itemsize == 2 else 64
        assert (config.block_n, config.num_warps, config.num_stages) == (block_n, 4, 2), shape
        # No bulk copies, no FP8 MMAs with the query split in e4m3fn terms, no pipelined tail.
        assert not config.tma and not config.qk_fp8 and config.tail_stages == 1


def test_fnuz_takes_e4m3fn_configs_but_qk_fp8_on_nvidia():
    for shape in SHAPES:
        if shape["kv_scale"] is None:
            continue
        fn = decode_launch_config(**shape)
        fnuz = decode_launch_config(**dict(shape, kv_dtype=FNUZ))
        assert not fnuz.qk_fp8
        # qk_fp8's per-token tile keeps 4 stages (shared memory); the exact path keeps 5.
        stages = 5 if fn.qk_fp8 and shape["kv_scale"] == "per_token" else fn.num_stages
        assert fnuz == type(fn)(**{**vars(fn), "qk_fp8": False, "num_stages": stages}), shape


def test_scheduler_and_reducer_keep_their_lanes_on_wave64():
    assert [target_warps(w, GFX942) for w in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [target_warps(w, None) for w in (1, 2, 4, 8)] == [1, 2, 4, 8]
    red = reduce_launch_config(rows=8, head_dim=128, records=500, sm_count=80, target=GFX942)
    assert red.num_warps == 2
    for batch in (64, 1024, 8192):
        sched = dict(batch=batch, num_programs=320, num_kv_heads=8, sm_count=80)
        nvidia = schedule_launch(None, **sched)
        amd = schedule_launch(None, **sched, target=GFX942)
        assert amd == type(nvidia)(**{**vars(nvidia), "warps": target_warps(nvidia.warps, GFX942)})


# -- builds on the CPU (Triton's interpreter off) --

_SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")

_BUILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import kernel_digest as kd
from pagedattn import launch

what = json.loads(sys.argv[2])
if what["target"] == "sm_90a":
    for name in what["names"]:
        v = next(v for v in kd.VARIANTS if v.name == name)
        print(kd.digest(kd.dataclasses.replace(v, kv="fnuz", name="fnuz-" + name)))
    sys.exit(0)
launch.AMD_SHARED_BYTES.update(what.get("budget", {}))
sys.exit(kd.amd_main(what["target"], what["names"], 1))
"""


def _build(**what) -> subprocess.CompletedProcess:
    """Runs ``_BUILD`` (as ``run_compiled`` does), returning the finished process."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    src = str(Path(pagedattn.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", _BUILD, _SCRIPTS, json.dumps(what)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip


def _fields(line: str) -> dict:
    return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)


def test_portable_kernels_build_for_gfx942_within_its_lds():
    # The largest LDS user (query_len 4 x 16 heads, per-token fnuz scales, gathered tiles),
    # a query_len-1 fnuz build, and the reducer with runs.
    names = ["fnuz-token-q4g16-d128-p16", "fnuz-tensor-q1-d128-p128-fp16q", "reduce-r8-runs"]
    run = _build(target="gfx942", names=names)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines] == names
    for line in lines:
        fields = _fields(line)
        assert int(fields["shared"]) <= AMD_SHARED_BYTES["gfx942"], line
        assert int(fields["spill"]) <= 4, line  # VGPRs spilled (launch.py's AMD tile note)


def test_amd_build_over_the_lds_fails():
    run = _build(target="gfx942", names=["reduce-r8-runs"], budget={"gfx942": 256})
    assert run.returncode == 1
    assert "FAILED: over the 256-byte LDS" in run.stdout


def test_fnuz_path_builds_for_sm90a():
    # What an NVIDIA GPU runs for an e4m3fnuz cache: e4m3fn bytes fixed in the kernel, with bulk
    # copies (page 128) and gathered (page 16), per token.
    names = ["fp8-token-q1-d128-p128-tma", "fp8-token-q4g16-d128-p16"]
    out = run_compiled(_BUILD, _SCRIPTS, json.dumps(dict(target="sm_90a", names=names)))
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["fnuz-" + n for n in names]
    assert all(_fields(line)["ptx"] for line in lines)
