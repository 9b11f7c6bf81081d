"""Fused Triton kernels for the small steps around the decoder's matrix products, on CUDA.

At batch 1 a large model's step on a GPU runs, in plain PyTorch ops, a thousand or more small kernels around
its matrix products (eight per RMSNorm, seven per RoPE, separate residual adds, K/V scatters and gathers), whose
launch gaps and memory traffic stay even under CUDA graphs (``bench/gpu_check.py --profile``; measured on an
H200 in ``bench/RESULTS.md``). Each of these does one of those steps in one launch:

- :func:`add_rms_norm`: the residual add and the RMSNorm that follows it (one row per program);
- :func:`rope_write_kv`: RoPE on the q and k heads of the fused q/k/v projection (q in place) and the
  k/v scatter into the paged cache (one token's head per program);
- :func:`silu_mul`: the MLP's ``silu(gate) * up``;
- :func:`dense_attention`: attention of the fixed-shape (CUDA-graph) layout read straight from the paged cache
  (no gathered K/V copies), keys split across programs (``ATTENTION_COLS_PER_SPLIT`` each; ``bench/gpu_check.py
  --attention-splits`` measures other choices) and a small kernel combining the splits.

The elementwise kernels round exactly where the PyTorch ops they replace round (a bfloat16 product is formed
in float32 and rounded before the next op), so only reduction order, ``rsqrt``/``exp`` approximations and, for
float32 models, fused multiply-adds differ; attention differs from SDPA as any two attention kernels do.

Importing this module imports Triton (:func:`ssd.models.decoder.fused_kernels_usable` checks first). With
``TRITON_INTERPRET=1`` set before the import, the same kernels run on CPU tensors (how the tests check them
on machines without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ATTENTION_COLS_PER_SPLIT = 64  # default keys per program of dense_attention (a decode step's parallelism)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=valid, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + row * n_cols + cols, mask=valid, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=valid)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=valid)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or ``x`` when None), then ``(rms_norm(h) * weight, h)``; ``x`` is ``[T, hidden]``."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x, residual.contiguous() if residual is not None else x, weight, out, res_out, cols, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols),
    )
    return out, res_out


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, key_ptr, value_ptr, slot_ptr, qkv_stride,
                          NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dim = tl.arange(0, HALF)
    base = qkv_ptr + token * qkv_stride + head * HEAD_DIM
    slot = tl.load(slot_ptr + token)
    if head < NUM_Q + NUM_KV:  # q or k head: rotate-half RoPE, rounding after each op as PyTorch does
        dtype = qkv_ptr.dtype.element_ty
        x1 = tl.load(base + dim)
        x2 = tl.load(base + HALF + dim)
        cos = tl.load(cos_ptr + token * HALF + dim).to(tl.float32)
        sin = tl.load(sin_ptr + token * HALF + dim).to(tl.float32)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        a = (x1f * cos).to(dtype).to(tl.float32) - (x2f * sin).to(dtype).to(tl.float32)
        b = (x2f * cos).to(dtype).to(tl.float32) + (x1f * sin).to(dtype).to(tl.float32)
        if head < NUM_Q:
            tl.store(base + dim, a.to(dtype))
            tl.store(base + HALF + dim, b.to(dtype))
        else:
            dest = key_ptr + (slot * NUM_KV + (head - NUM_Q)) * HEAD_DIM
            tl.store(dest + dim, a.to(key_ptr.dtype.element_ty))
            tl.store(dest + HALF + dim, b.to(key_ptr.dtype.element_ty))
    else:  # v head: copied into the cache as it is
        full = tl.arange(0, HEAD_DIM)
        dest = value_ptr + (slot * NUM_KV + (head - NUM_Q - NUM_KV)) * HEAD_DIM
        tl.store(dest + full, tl.load(base + full).to(value_ptr.dtype.element_ty))


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2*Hkv) * D], rows contiguous
    cos: torch.Tensor,  # [T, 1, D/2]
    sin: torch.Tensor,  # [T, 1, D/2]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Rotate the q heads of ``qkv`` in place and write rotated k and plain v to their cache slots.
    Returns the rotated queries ``[T, H, D]`` (a view of ``qkv``)."""
    tokens = qkv.shape[0]
    if qkv.stride(1) != 1 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_write_kv needs contiguous rows and a power-of-two head_dim, got {head_dim}")
    _rope_write_kv_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, cos.contiguous(), sin.contiguous(), key_cache, value_cache, slot_mapping, qkv.stride(0),
        NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
    )
    return qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up).to(dtype), mask=valid)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[T, 2*I]`` gate/up projection; returns ``[T, I]``."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    cols = width // 2
    out = gate_up.new_empty(rows, cols)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, cols, BLOCK=block)
    return out


@triton.jit
def _dense_attention_split_kernel(
    q_ptr, key_ptr, value_ptr, slots_ptr, mask_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, scale, kv_len,
    cols_per_split, q_stride, Q: tl.constexpr, GROUP: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (sequence, KV head, key split): online softmax over the split's columns for the Q * GROUP query rows
    that share the KV head (packed as rows: query i = row // GROUP, head = kv_head * GROUP + row % GROUP)."""
    seq_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = seq_head // NUM_KV
    kv_head = seq_head % NUM_KV
    rows = tl.arange(0, ROWS)
    row_ok = rows < Q * GROUP
    query_index = seq * Q + rows // GROUP  # [ROWS] row of the flat batch
    head = kv_head * GROUP + rows % GROUP
    dim = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (query_index.to(tl.int64) * q_stride + head * HEAD_DIM)[:, None] + dim[None, :],
                mask=row_ok[:, None], other=0.0)  # [ROWS, D]
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    start = split * cols_per_split
    stop = tl.minimum(start + cols_per_split, kv_len)
    for first in range(start, stop, BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        col_ok = cols < stop
        slot = tl.load(slots_ptr + seq * kv_len + cols, mask=col_ok, other=0)
        offsets = ((slot * NUM_KV + kv_head) * HEAD_DIM)[:, None] + dim[None, :]  # [BLOCK_N, D]
        k = tl.load(key_ptr + offsets, mask=col_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, BLOCK_N] float32
        allowed = tl.load(mask_ptr + query_index[:, None] * kv_len + cols[None, :],
                          mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet
        probs = tl.exp(scores - safe_max[:, None])  # [ROWS, BLOCK_N]
        rescale = tl.exp(run_max - safe_max)  # [ROWS]
        run_sum = run_sum * rescale + tl.sum(probs, 1)
        v = tl.load(value_ptr + offsets, mask=col_ok[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        run_max = new_max
    part = seq_head * NUM_SPLITS + split
    tl.store(part_acc_ptr + ((part * ROWS + rows) * HEAD_DIM)[:, None] + dim[None, :], acc)
    tl.store(part_max_ptr + part * ROWS + rows, run_max)
    tl.store(part_sum_ptr + part * ROWS + rows, run_sum)


@triton.jit
def _dense_attention_reduce_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, Q: tl.constexpr, GROUP: tl.constexpr,
    NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    """Combine the splits of one packed query row into its attention output."""
    seq_head = tl.program_id(0)
    row = tl.program_id(1)
    seq = seq_head // NUM_KV
    kv_head = seq_head % NUM_KV
    splits = tl.arange(0, SPLITS_POW2)
    split_ok = splits < NUM_SPLITS
    part = seq_head * NUM_SPLITS + splits
    maxes = tl.load(part_max_ptr + part * ROWS + row, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part * ROWS + row, mask=split_ok, other=0.0)
    top = tl.max(maxes, 0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - top))  # splits that saw no visible key: 0
    dim = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + ((part * ROWS + row) * HEAD_DIM)[:, None] + dim[None, :], mask=split_ok[:, None],
                  other=0.0)  # [SPLITS, D]
    out = tl.sum(acc * weights[:, None], 0) / tl.sum(sums * weights, 0)
    head = kv_head * GROUP + row % GROUP
    tl.store(out_ptr + ((seq * Q + row // GROUP) * (NUM_KV * GROUP) + head) * HEAD_DIM + dim,
             out.to(out_ptr.dtype.element_ty))


def dense_attention(
    query: torch.Tensor,  # [B*Q, H, D]; heads and dims contiguous (a view into the q/k/v projection will do)
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    kv_slots: torch.Tensor,  # [B, L] int64
    mask: torch.Tensor,  # [B, 1, Q, L] bool
    scale: float,
    cols_per_split: int | None = None,
) -> torch.Tensor:
    """Attention of the fixed-shape layout (``DenseAttentionMetadata``) read straight from the paged cache:
    no gathered copies of K/V, the key length split across programs (flash-decoding) so a single decode
    step still fills the GPU, and one small kernel to combine the splits. Returns ``[B*Q, H, D]``."""
    batch, _, q_len, kv_len = mask.shape
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[-2]
    group = num_heads // num_kv_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"dense_attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    rows = max(16, triton.next_power_of_2(q_len * group))  # tl.dot wants at least 16 rows
    cols_per_split = cols_per_split or ATTENTION_COLS_PER_SPLIT
    num_splits = triton.cdiv(kv_len, cols_per_split)
    part_acc = query.new_empty(batch * num_kv_heads * num_splits * rows * head_dim, dtype=torch.float32)
    part_max = query.new_empty(batch * num_kv_heads * num_splits * rows, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # float32 models: no TF32 rounding
    _dense_attention_split_kernel[(batch * num_kv_heads, num_splits)](
        query, key_cache, value_cache, kv_slots, mask, part_acc, part_max, part_sum, scale, kv_len,
        cols_per_split, query.stride(0), Q=q_len, GROUP=group, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, ROWS=rows,
        BLOCK_N=min(cols_per_split, 64), NUM_SPLITS=num_splits, PRECISION=precision,
    )
    out = query.new_empty(query.shape)  # contiguous, whatever the query's row stride
    _dense_attention_reduce_kernel[(batch * num_kv_heads, q_len * group)](
        part_acc, part_max, part_sum, out, Q=q_len, GROUP=group, NUM_KV=num_kv_heads, HEAD_DIM=head_dim,
        ROWS=rows, NUM_SPLITS=num_splits, SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)),
    )
    return out
