"""A stand-in for `sgl_kernel`, SGLang's compiled kernel package, in the SGLang engines the
real-SGLang tests start (their PYTHONPATH leads here), never in the router or the tests.

Why: no CPU build of `sgl_kernel` is on PyPI (the CUDA wheel is 373 MB and does not load here;
the CPU build is compiled from SGLang's repository), yet SGLang 0.5.23 on CPU
(`SGLANG_USE_CPU_ENGINE=1`, torch-native attention and sampler) imports it for exactly two ops:

- `assign_req_to_token_pool_cpu` — `sglang/srt/mem_cache/allocation.py`
  `assign_req_to_token_pool_func`, the CPU twin of the Triton kernel `assign_req_to_token_pool`:
  write each request's newly allocated KV locations into its row of the request-to-token table;
- `copy_all_layer_kv_cache_cpu` — `sglang/kernels/ops/kvcache/cache_move.py`
  `copy_all_layer_kv_cache`, the CPU twin of `copy_all_layer_kv_cache_tiled`: copy KV slots from
  source to target locations in every layer's buffer (given as raw data pointers and row strides).

Both are written here in plain torch from those kernels' semantics, and tested against a direct
computation (tests/real_sglang/test_engine_site.py). The day SGLang ships a CPU `sgl_kernel` on
PyPI this package can be deleted. SGLang's CPU build also imports other ops by name at start-up
(speculative decoding's tree kernels, for one) that this path never calls: any other name is
given as a function that raises when called, so a path this suite does not know about fails
loudly where it is taken, never computes garbage."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i of the batch: `req_to_token[req_pool_indices[i], start[i]:end[i]]`
    takes the next `end[i] - start[i]` entries of `out_cache_loc` (the requests' new
    locations, concatenated in batch order)."""
    del pool_len  # the row length; the Triton kernel needs it for its pointer arithmetic
    taken = 0
    rows = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def _rows(pointer: int, row_bytes: int, rows: int) -> torch.Tensor:
    """The first `rows` rows of a buffer given by its address, as a (rows, row_bytes) uint8
    view (no copy)."""
    raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(pointer)
    return torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In each buffer b (address `data_ptrs[b]`, `strides[b]` bytes a row): row `tgt_loc[j]`
    becomes a copy of row `src_loc[j]`, for every j (sources read before any target is
    written, as the GPU kernel's separate loads and stores give)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.long), src_loc.to(torch.long)
    rows = int(max(int(tgt.max()), int(src.max()))) + 1
    for pointer, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        view = _rows(int(pointer), int(row_bytes), rows)
        view[tgt] = view[src].clone()


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)  # the import system's probes (__path__, __file__, ...)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: this stand-in (tests/real_sglang/engine_site) provides only "
            f"{', '.join(__all__)}; SGLang took a path that needs the compiled package"
        )

    missing.__name__ = name
    return missing
