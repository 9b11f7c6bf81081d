"""Weight formats ``"q8_0"``, ``"q4_0"`` and ``"q4_1"``: weights in blocks of 32 sharing one float16 scale,
multiplied by activations quantized to int8 in blocks of 32 per row; integer products, float32 out (CPU, C++
kernel).

The blocks are GGUF's: ``q8_0`` holds int8 values (``w = d * q``), ``q4_0`` 4-bit values (``w = d * (q - 8)``,
``q`` in 0..15, the scale ``d`` chosen so that the block's largest magnitude maps to -8), ``q4_1`` 4-bit
values and a float16 minimum (``w = d * q + m``, the block's range in 15 steps), so a GGUF file's Q8_0 / Q4_0
/ Q4_1 tensors are used as stored, and a float checkpoint is quantized at load the way llama.cpp's converter
does. Q4_K (super-blocks of 256: float16 ``d`` and ``dmin``, 6-bit scale and minimum per block of 32, ``w = d
* s * q - dmin * m``) runs as a GGUF file stores it (there is no quantizer for it here); the kernel forms each
block's scale and minimum from them (exact float products), and holds it in 5 bits per weight (the file: 4.5).
Activations are quantized per block of 32 (``s = max|x| / 127``), as llama.cpp's CPU kernels do for these
formats: finer than one scale per row (``"w8a8"``), so outlier channels cost less precision.

Why a kernel of our own: a decode step, a verification (K + 1 rows) or an SSD tree step (a row per branch)
multiplies a few rows by every weight, so on CPU it should cost what reading the weights costs. PyTorch's
int8 / int4 weight-only CPU kernels cost by rows, and llama.cpp's do too (``bench/RESULTS.md``, "Numbers behind
the CPU code"). This kernel (``csrc/block_quant.cpp``) puts 16 output channels in the 16 lanes of an
AVX-512 register, so one VNNI instruction adds four products to each of them: a block of 32 inputs costs
8 instructions per row and 16 channels, the weights are read once and used by up to 12 rows from registers,
and the float work per block (convert, scale, add) is shared by 16 channels. ``bench/cpu_products.py``
measures it against the others on the machine at hand.

Batch invariance: a row's activations are quantized from that row alone and each of its outputs is computed by
one fixed sequence of operations (per block, in order, an exact int32 sum, then one float fused multiply-add
by the weight scale times the activation scale), so its result is bitwise the same whatever rows share the
call. The portable C++ path (CPUs without AVX-512 VNNI) performs the same operations and gives the same bits.
A model in these formats is a quantized model: exact in every mode relative to itself; as a target it computes
attention with the row-invariant kernel, like ``"w8a8"``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ssd.models.native import cpu_kernels, cpu_kernels_available

BLOCK = 32  # weights sharing one scale
CHUNK = 64  # the kernel's step along the input: two blocks (inputs are padded to it)
SUPER_BLOCK = 256  # Q4_K's super-block
GROUP = 16  # output channels the kernel takes together, one per vector lane (outputs are padded to it)
# config.json's quantization_config["quant_method"] of a checkpoint whose projections are stored as GGUF blocks
# (a GGUF import with keep_blocks); its "block_types" maps each such tensor to its BlockKind value
STORED_BLOCKS_METHOD = "gguf_blocks"


class BlockKind(enum.Enum):
    """GGUF block types with a kernel here."""

    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q4_K = "q4_k"  # from GGUF files only (no quantizer here): super-blocks of 256, 6-bit block scales

    @property
    def bits(self) -> int:
        return 8 if self is BlockKind.Q8_0 else 4

    @property
    def has_min(self) -> bool:
        """Whether a block also has a minimum (``w = d * q + m``)."""
        return self in (BlockKind.Q4_1, BlockKind.Q4_K)

    @property
    def gguf_unit(self) -> tuple[int, int]:
        """(inputs, bytes) of the GGUF file's unit of storage: a block of 32 (its float16 scale and minimum,
        then the values), or Q4_K's super-block of 256."""
        if self is BlockKind.Q4_K:
            return SUPER_BLOCK, 4 + 12 + SUPER_BLOCK // 2
        return BLOCK, 2 * (2 if self.has_min else 1) + BLOCK * self.bits // 8

    @property
    def offset(self) -> int:
        """What the kernel adds to a stored value to make it unsigned."""
        return {BlockKind.Q8_0: 128, BlockKind.Q4_0: 8}.get(self, 0)

    @property
    def code(self) -> int:
        """The kernel's number for this kind (``Kind`` in ``csrc/block_quant.cpp``)."""
        return list(BlockKind).index(self)


@dataclass(frozen=True)
class Blocks:
    """A weight [out, in] in blocks of 32 inputs, inputs padded to 64 with zero weights (scale 0): ``values``
    [out, in_p] int8 (q8_0: q; q4_0: q - 8; q4_1, q4_k: q in 0..15), ``scales`` [out, in_p / 32] float16 and,
    for q4_1, ``mins`` likewise (``w = scale * value (+ min)``). q4_k: ``scales`` and ``mins`` are the 6-bit
    integers of each block (uint8) and ``supers`` [out, in_p / 256, 2] float16 each super-block's ``d`` and
    ``dmin``: ``w = d * scale * q - dmin * min``."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    supers: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """Float32 weights [out, in_p]."""
        out_features = self.values.shape[0]
        scales = self.scales.float()
        mins = None if self.mins is None else self.mins.float()
        if self.supers is not None:
            per_block = self.supers.float().repeat_interleave(SUPER_BLOCK // BLOCK, dim=1)  # [out, blocks, 2]
            scales, mins = per_block[..., 0] * scales, -(per_block[..., 1] * mins)
        w = self.values.view(out_features, -1, BLOCK).float() * scales.unsqueeze(-1)
        if mins is not None:
            w = w + mins.unsqueeze(-1)
        return w.view(out_features, -1)


def available() -> bool:
    """Whether the kernel compiled (or was found compiled) on this machine; logs why not."""
    return cpu_kernels_available()


def vectorized() -> bool:
    """Whether the kernel runs its AVX-512 VNNI path here (else the portable one, same results)."""
    return bool(cpu_kernels().block_quant_vectorized())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def quantize_blocks(weight: torch.Tensor, kind: BlockKind) -> Blocks:
    """``weight`` [out, in] in blocks, as llama.cpp's reference quantizers make them (``quantize_row_q8_0`` /
    ``_q4_0`` / ``_q4_1``: the step computed in float32, stored in float16)."""
    if kind is BlockKind.Q4_K:
        raise ValueError("q4_k has no quantizer here: it runs the blocks of a GGUF file as stored "
                         "(convert_gguf(..., keep_blocks=True))")
    out_features, in_features = weight.shape
    w = torch.zeros(out_features, _round_up(in_features, CHUNK), dtype=torch.float32)
    w[:, :in_features] = weight.detach().float()
    blocks = w.view(out_features, -1, BLOCK)  # [out, in_p / 32, 32]

    def inverse(step: torch.Tensor) -> torch.Tensor:
        return torch.where(step != 0, 1.0 / step, torch.zeros_like(step)).unsqueeze(-1)

    if kind is BlockKind.Q8_0:  # the largest magnitude maps to 127, rounding half away from zero
        step = blocks.abs().amax(dim=-1) / 127.0
        scaled = blocks * inverse(step)
        values, mins = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5), None
    elif kind is BlockKind.Q4_0:  # the signed value of largest magnitude maps to -8
        step = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True)).squeeze(-1) / -8.0
        values, mins = torch.trunc(blocks * inverse(step) + 8.5).clamp(0, 15) - 8, None
    else:  # the block's range in 15 steps from its minimum
        low = blocks.amin(dim=-1)
        step = (blocks.amax(dim=-1) - low) / 15.0
        values, mins = torch.trunc((blocks - low.unsqueeze(-1)) * inverse(step) + 0.5).clamp(0, 15), low.half()
    return Blocks(values.to(torch.int8).view(out_features, -1), step.half(), mins)


def blocks_from_gguf(raw: torch.Tensor, kind: BlockKind, in_features: int) -> Blocks:
    """A GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K tensor's bytes ``raw`` [out, in / unit x unit bytes] uint8 as
    :class:`Blocks`, bit for bit. A block is a float16 scale (Q4_1: and a float16 minimum), then 32 int8 values
    (Q8_0) or 16 bytes, byte j holding value j (low nibble) and value j + 16 (high nibble), each ``q`` in 0..15
    (Q4_0: meaning ``q - 8``). A Q4_K super-block is ``d`` and ``dmin`` (float16), 12 bytes of eight 6-bit
    scales and minimums, and 128 bytes of nibbles, byte j of each 32 holding value j of a 64-value run (low)
    and value 32 + j (high)."""
    unit, unit_bytes = kind.gguf_unit
    if in_features % unit:
        raise ValueError(f"a {kind.value} tensor's rows must hold whole blocks of {unit}; got {in_features}")
    out_features, units = raw.shape[0], in_features // unit
    if raw.dtype != torch.uint8 or raw.shape[1] != units * unit_bytes:
        raise ValueError(f"{kind.value} rows of {in_features} values take {units * unit_bytes} bytes; got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    cells = raw.contiguous().view(out_features, units, unit_bytes)
    if kind is BlockKind.Q4_K:
        return _q4_k_blocks(cells, in_features)
    head = 4 if kind.has_min else 2
    halves = cells[..., :head].contiguous().view(torch.float16).view(out_features, units, -1)
    if kind is BlockKind.Q8_0:
        q = cells[..., head:].contiguous().view(torch.int8)
    else:
        packed = cells[..., head:]
        q = (torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int16) - kind.offset).to(torch.int8)
    in_p = _round_up(in_features, CHUNK)
    values = torch.zeros(out_features, in_p, dtype=torch.int8)
    values[:, :in_features] = q.reshape(out_features, in_features)

    def padded(column: int) -> torch.Tensor:
        out = torch.zeros(out_features, in_p // BLOCK, dtype=torch.float16)
        out[:, :units] = halves[..., column]
        return out

    return Blocks(values, padded(0), padded(1) if kind.has_min else None)


def _q4_k_blocks(cells: torch.Tensor, in_features: int) -> Blocks:
    """Q4_K super-blocks ``cells`` [out, supers, 144] as :class:`Blocks` (inputs are whole super-blocks, so
    already a multiple of 64)."""
    out_features, supers = cells.shape[:2]
    d_dmin = cells[..., :4].contiguous().view(torch.float16).view(out_features, supers, 2)
    packed = cells[..., 4:16].to(torch.int32).view(out_features, supers, 3, 4)
    low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    # blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); blocks 4-7: a nibble of bytes 8-11
    # plus the top 2 bits of bytes 0-3 (scales) or 4-7 (minimums)
    scales = torch.cat([low & 63, (both & 15) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (both >> 4) | ((high >> 6) << 4)], dim=-1)
    nibbles = cells[..., 16:].view(out_features, supers, 4, 1, 32)  # 4 runs of 64 values: byte j, low / high
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3).view(out_features, in_features)
    return Blocks(q.to(torch.int8).contiguous(), scales.view(out_features, -1).to(torch.uint8),
                  mins.view(out_features, -1).to(torch.uint8), d_dmin)


def _kernel_layout(blocks: Blocks, kind: BlockKind) -> torch.Tensor:
    """``blocks`` as the kernel reads them: ``[group of 16 channels, chunk bytes x chunks]`` uint8, each group
    one sequential stream of 64-input chunks, a chunk being the two blocks' float16 scales (channel minor; then
    their minimums, q4_1; q4_k: its super-block's d and -dmin, then the two blocks' 6-bit scales and
    minimums as bytes) and each block's values with channel j in 32-bit lane j (``csrc/block_quant.cpp`` draws
    it): q8_0 as unsigned ``q + 128``, 4 inputs per lane and vector; 4-bit kinds as nibbles ``q`` in 0..15,
    byte i of a lane holding input 4v + i (low) and 16 + 4v + i (high) of vector v. Channels are padded to 16."""
    out_features, in_p = blocks.values.shape
    rows, chunks = _round_up(out_features, GROUP), in_p // CHUNK
    groups = rows // GROUP
    unsigned = torch.zeros(rows, in_p, dtype=torch.int16)
    unsigned[:out_features] = blocks.values.to(torch.int16) + kind.offset
    if kind is BlockKind.Q8_0:  # [group, lane, chunk, block, vector t, byte i] -> [group, chunk, block, t, lane, i]
        cells = unsigned.to(torch.uint8).view(groups, GROUP, chunks, 2, 8, 4).permute(0, 2, 3, 4, 1, 5)
    else:  # [group, lane, chunk, block, half, vector v, byte i] -> low | high << 4 -> [group, chunk, block, v, lane, i]
        halves = unsigned.to(torch.uint8).view(groups, GROUP, chunks, 2, 2, 4, 4)
        cells = (halves[:, :, :, :, 0] | (halves[:, :, :, :, 1] << 4)).permute(0, 2, 3, 4, 1, 5)

    def per_chunk(table: torch.Tensor) -> torch.Tensor:
        """[out, chunks, k] -> [groups, chunks, k x 16 lanes] bytes, channel minor."""
        padded = torch.zeros(rows, *table.shape[1:], dtype=table.dtype)
        padded[:out_features] = table
        lanes = padded.view(groups, GROUP, chunks, -1).permute(0, 2, 3, 1).contiguous()
        return lanes.view(torch.uint8).view(groups, chunks, -1)

    if kind is BlockKind.Q4_K:
        supers = blocks.supers.repeat_interleave(SUPER_BLOCK // CHUNK, dim=1)  # [out, chunks, 2]: d, dmin
        supers = torch.stack([supers[..., 0], -supers[..., 1]], dim=-1)
        tables = [supers, blocks.scales.view(out_features, chunks, 2), blocks.mins.view(out_features, chunks, 2)]
        parts = [per_chunk(t) for t in tables]
    else:
        tables = [blocks.scales] + ([blocks.mins] if kind.has_min else [])
        parts = [per_chunk(t.view(out_features, chunks, 2)) for t in tables]
    return torch.cat([*parts, cells.reshape(groups, chunks, -1)], dim=-1).view(groups, -1).contiguous()


class BlockQuantProduct:
    """``x @ W.T (+ bias)`` with ``W`` held in blocks (:class:`BlockKind`); ``x`` and the result are float32.
    Called like ``F.linear(x, weight, bias)``; ``weight`` is ignored (the quantized copy is used);
    ``portable=True`` takes the kernel's portable path where the vector one exists (same bits; for tests)."""

    def __init__(self, weight: torch.Tensor, kind: BlockKind = BlockKind.Q4_0) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a quantized weight must be a 2-D CPU tensor, got {tuple(weight.shape)} on "
                             f"{weight.device}")
        self._init(quantize_blocks(weight, kind), kind, weight.shape[1])

    @classmethod
    def from_blocks(cls, blocks: Blocks, kind: BlockKind, in_features: int) -> "BlockQuantProduct":
        """A product over blocks already quantized (GGUF tensors kept as stored; :class:`Blocks`)."""
        values, scales = blocks.values, blocks.scales
        scale_dtype = torch.uint8 if kind is BlockKind.Q4_K else torch.float16
        if values.dtype != torch.int8 or scales.dtype != scale_dtype or values.shape[1] % CHUNK:
            raise ValueError(f"{kind.value} blocks must be int8 values padded to {CHUNK} inputs and {scale_dtype} "
                             f"scales; got {values.dtype} {tuple(values.shape)}, {scales.dtype} "
                             f"{tuple(scales.shape)}")
        if (blocks.mins is not None) != kind.has_min:
            raise ValueError(f"{kind.value} blocks {'need' if kind.has_min else 'have no'} minimums")
        product = cls.__new__(cls)
        product._init(blocks, kind, in_features)
        return product

    def _init(self, blocks: Blocks, kind: BlockKind, in_features: int) -> None:
        self.kind = kind
        self.kind_code = kind.code  # the kernel's number, looked up once (an enum's index is not free per call)
        self.in_features = in_features
        self.out_features = blocks.values.shape[0]
        self.packed = _kernel_layout(blocks, kind)
        self.module = cpu_kernels()  # compiled once, before the first product

    @property
    def nbytes(self) -> int:
        """Bytes the product holds (values, scales and minimums, with padding)."""
        return self.packed.numel()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 portable: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = self.module.block_quant_linear(rows, self.packed, self.kind_code, self.out_features, portable)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias


def stored_block_types(hf_config: dict) -> dict[str, BlockKind]:
    """Checkpoint tensor name -> kind of the projections a checkpoint stores as GGUF blocks (none: {})."""
    quantization = hf_config.get("quantization_config") or {}
    if quantization.get("quant_method") != STORED_BLOCKS_METHOD:
        return {}
    return {name: BlockKind(kind) for name, kind in quantization.get("block_types", {}).items()}
