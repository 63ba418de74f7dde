"""The stand-in `sgl_kernel` ops (engine_site/sgl_kernel), checked against a direct computation
of what SGLang's Triton kernels do, in the SGLang venv (it has torch; the router's does not)."""

from __future__ import annotations

import subprocess

import pytest

from tests.real_sglang.conftest import ENGINE_SITE, PYTHON

pytestmark = pytest.mark.real_sglang

CHECK = r"""
import torch
from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
import sgl_kernel

# assign: requests 2 and 0 get new locations [start, end) of their rows, taken in batch order
table = torch.zeros((3, 10), dtype=torch.int32)
locs = torch.arange(100, 107, dtype=torch.int64)
assign_req_to_token_pool_cpu(
    torch.tensor([2, 0]), table, torch.tensor([1, 4]), torch.tensor([4, 8]), locs, 10
)
want = torch.zeros((3, 10), dtype=torch.int32)
want[2, 1:4] = torch.tensor([100, 101, 102], dtype=torch.int32)
want[0, 4:8] = torch.tensor([103, 104, 105, 106], dtype=torch.int32)
assert torch.equal(table, want), table

# copy: in every layer's buffer, rows tgt <- rows src, sources read before targets written
layers = [torch.randn(8, 6), torch.randn(8, 6, dtype=torch.float64)]
before = [b.clone() for b in layers]
ptrs = torch.tensor([b.data_ptr() for b in layers], dtype=torch.int64)
strides = torch.tensor([b.stride(0) * b.element_size() for b in layers], dtype=torch.int64)
tgt, src = torch.tensor([1, 5, 3]), torch.tensor([3, 0, 1])
copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
for b, old in zip(layers, before):
    expect = old.clone()
    expect[tgt] = old[src]
    assert torch.equal(b, expect)
copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([], dtype=torch.int64), torch.tensor([]))

# any other op: importable (SGLang imports some at start-up), refused when called
other = sgl_kernel.build_tree_kernel_efficient_cpu
try:
    other()
except NotImplementedError as exc:
    assert "stand-in" in str(exc)
else:
    raise AssertionError("an unknown op ran")
print("ok")
"""


def test_the_stand_in_ops_do_what_sglangs_kernels_do() -> None:
    proc = subprocess.run(
        [str(PYTHON), "-c", CHECK],
        env={"PYTHONPATH": str(ENGINE_SITE), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


MOONCAKE_CHECK = r"""
import sglang.srt.disaggregation.mooncake.conn as conn
assert conn.MooncakeKVSender.supports_host_tensor_indices is False
print("ok")
"""


def test_the_mooncake_sender_is_told_to_keep_its_indices_on_the_host() -> None:
    proc = subprocess.run(
        [str(PYTHON), "-c", MOONCAKE_CHECK],
        env={"PYTHONPATH": str(ENGINE_SITE), "PATH": "/usr/bin:/bin", "SGLANG_USE_CPU_ENGINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
