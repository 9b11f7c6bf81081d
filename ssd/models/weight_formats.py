"""Weight formats: how a model's projections and LM head hold their weights, and switching a model to them.

On CPU a decode step, a verification or a draft tree step multiplies a few rows by every weight matrix, so its
time is the time to stream the weights; FBGEMM's packed products do that far better than float32 GEMM for these
shapes (``packed_fp16.py``, ``packed_int8.py``, ``rowwise_int8.py`` with the measurements).

Formats (``weight_format`` for the target, ``draft_weight_format`` for the draft):

- ``"dense"``: weights in the model's ``dtype``;
- ``"fp16-packed"``: float16 weights packed for FBGEMM, computing in float32 (``ssd/models/packed_fp16.py``);
  CPU, ``float32`` models, FBGEMM only;
- ``"int8-packed"``: drafts only, same conditions: int8 weights and inputs (``ssd/models/packed_int8.py``) for
  the attention and gate/up projections, float16-packed for the rest (:data:`INT8_EXEMPT`, the LM head);
- ``"w8a8"``: targets and drafts, same conditions: int8 weights per output channel times int8 activations
  quantized per row, for every projection and the LM head (``ssd/models/rowwise_int8.py``); batch-invariant
  products, close to flat in the row count up to ~8 rows. A w8a8 target also needs the row-invariant attention
  kernel (compiled on first use; its runner refuses to start where it cannot be) and is a quantized model;
- ``"q8_0"`` / ``"q4_0"`` / ``"q4_1"``: targets and drafts, CPU and ``float32`` models (no FBGEMM needed: a
  C++ kernel, compiled on first use): GGUF's blocks of 32 int8 / 4-bit weights with one float16 scale (and, in
  ``"q4_1"``, a float16 minimum), times activations quantized to int8 in blocks of 32 per row
  (``ssd/models/block_quant.py``); the 4-bit formats keep the LM head in ``"q8_0"``. Batch-invariant; a
  model in them computes attention with the row-invariant kernel (a target needs it; for a draft it is the faster
  attention) and runs its layers in one C++ call (``ssd/models/layer_stack.py``); a target in them is a quantized
  model, like ``"w8a8"``;
- ``"gguf"``: the same kernel over the blocks a checkpoint stores (a GGUF import with ``keep_blocks``: its
  Q8_0 / Q4_0 / Q4_1 / Q4_K projections as the file holds them), the LM head (and any projection stored in
  float, or fused from parts of different types) in ``"q8_0"``; the only format such a checkpoint runs in, and
  what ``"auto"`` means for it;
- ``"auto"`` (both defaults): for a target, ``"fp16-packed"`` where it applies, else ``"dense"``; it applies
  only when ``dtype="auto"`` chose float32 (on any CPU with FBGEMM: float16 weights in this GEMM are the
  fastest precision for few-row products there, see ``ssd/dtypes.py``, and finer than bfloat16); an explicit
  ``dtype="float32"`` keeps float32 weights. For a draft on CPU in float32, ``"q8_0"`` where the block kernel
  compiled with its AVX-512 VNNI path (the fastest draft steps measured, at unchanged acceptance: README
  "Weight formats"), else ``"w8a8"`` where the packed formats apply and the CPU has VNNI, else
  ``"fp16-packed"`` where it applies, else ``"dense"``. A draft's numerics never change the output, only how
  often its guesses are accepted.

All modes of an engine use the same target, so speculative outputs still equal its autoregressive ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ssd.models.block_quant import BlockKind, BlockQuantProduct
from ssd.models.block_quant import available as block_kernel_available
from ssd.models.block_quant import vectorized as block_kernel_vectorized
from ssd.models.packed_fp16 import PackedFp16Product
from ssd.models.packed_int8 import PackedInt8Product
from ssd.models.rowwise_int8 import RowwiseInt8Product, has_vnni
from ssd.options import BLOCK_WEIGHT_FORMATS, PACKED_WEIGHT_FORMATS, TARGET_WEIGHT_FORMATS, Dtype, WeightFormat

# Projections that "int8-packed" keeps in float16 (as well as the LM head): the MLP's down projection reads the
# gated activation, whose few large channels would coarsen the per-tensor 8-bit input of every row (with
# them in int8 the default draft's acceptance on code fell 4-6%; without, it is unchanged within noise).
INT8_EXEMPT = ("down_proj",)


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_weight_format(
    weight_format: WeightFormat | str, device: str, dtype: Dtype | str, explicit_dtype: bool = False,
    draft: bool = False, stored_blocks: bool = False,
) -> WeightFormat:
    """The concrete format (not ``"auto"``) of a model on ``device`` in ``dtype`` (a resolved dtype name);
    ``explicit_dtype``: the user named the dtype (a target's ``"auto"`` then keeps dense weights); ``draft``:
    the model is a draft (``"int8-packed"`` allowed); ``stored_blocks``: its checkpoint stores GGUF blocks
    (``loader.stores_blocks``), which run in ``"gguf"`` only. Raises ``ValueError`` for an unknown format or a
    packed format that cannot run there."""
    allowed = list(WeightFormat) if draft else TARGET_WEIGHT_FORMATS
    if weight_format not in allowed:
        raise ValueError(f"weight format {weight_format!r} is not supported; choose one of "
                         f"{[f.value for f in allowed]}")
    weight_format = WeightFormat(weight_format)
    if stored_blocks:
        if weight_format not in (WeightFormat.AUTO, WeightFormat.GGUF):
            raise ValueError(f"this checkpoint stores GGUF blocks (imported with keep_blocks), which run in weight "
                             f"format 'gguf' (or 'auto'); got {weight_format.value!r}")
        weight_format = WeightFormat.GGUF
    elif weight_format is WeightFormat.GGUF:
        raise ValueError("weight format 'gguf' runs the blocks a GGUF import kept (convert_gguf(..., "
                         "keep_blocks=True)); this checkpoint stores none")
    on_cpu = str(device).startswith("cpu") and dtype == Dtype.FLOAT32
    applies = on_cpu and fbgemm_available()
    if weight_format in BLOCK_WEIGHT_FORMATS:
        if not on_cpu:
            raise ValueError(f"weight format {weight_format.value!r} needs a CPU device and dtype float32; got "
                             f"device {device!r}, dtype {dtype!r}")
        if not block_kernel_available():
            raise ValueError(f"weight format {weight_format.value!r} needs its C++ kernel, which could not be "
                             "compiled here (a C++ compiler and ninja are needed; the log says why)")
        return weight_format
    if weight_format is WeightFormat.AUTO:
        if draft and on_cpu and block_kernel_available() and block_kernel_vectorized():
            return WeightFormat.Q8_0
        if draft and applies and has_vnni():
            return WeightFormat.W8A8
        return WeightFormat.FP16_PACKED if applies and not explicit_dtype else WeightFormat.DENSE
    if weight_format in PACKED_WEIGHT_FORMATS and not applies:
        raise ValueError(
            f"weight format {weight_format.value!r} needs a CPU device, dtype float32 and PyTorch's FBGEMM backend; got "
            f"device {device!r}, dtype {dtype!r}, quantized engines {torch.backends.quantized.supported_engines}"
        )
    return weight_format


def pack_weights(model: nn.Module, weight_format: WeightFormat) -> int:
    """Switch every projection of ``model`` (a :class:`ssd.models.decoder.DecoderLM`) and its LM head to the
    packed product of ``weight_format`` (``PACKED_WEIGHT_FORMATS``; ``"int8-packed"`` keeps float16 where
    :data:`INT8_EXEMPT` says, and for the head); a projection's float32 weight is released (the tied embedding
    stays: the input lookup reads it). Returns the number of matrices packed."""
    if weight_format not in PACKED_WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r} is not packed; choose one of "
                         f"{[f.value for f in PACKED_WEIGHT_FORMATS]}")
    count = 0
    for name, module in model.named_modules():
        if isinstance(getattr(module, "matmul", None), BlockQuantProduct):
            continue  # stored as GGUF blocks: already a product over them
        if isinstance(module, nn.Linear) and hasattr(module, "matmul"):
            module.matmul = _product(weight_format, name)(module.weight)
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
            count += 1
    model.head_matmul = _product(weight_format, "lm_head")(model.head_weight)
    return count + 1


def _product(weight_format: WeightFormat, name: str) -> Callable[[torch.Tensor], Callable]:
    """The packed product (a callable of the float weight) a matrix named ``name`` gets in ``weight_format``."""
    if weight_format == WeightFormat.W8A8:
        return RowwiseInt8Product
    if weight_format in BLOCK_WEIGHT_FORMATS:
        in_q8_0 = name == "lm_head" or weight_format is WeightFormat.GGUF  # the head; a float one beside blocks
        kind = BlockKind.Q8_0 if in_q8_0 else BlockKind(weight_format.value)
        return functools.partial(BlockQuantProduct, kind=kind)
    if weight_format == WeightFormat.INT8_PACKED and not name.endswith(INT8_EXEMPT + ("lm_head",)):
        return PackedInt8Product
    return PackedFp16Product
