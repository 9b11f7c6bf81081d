"""What the ``"auto"`` options of a configuration mean on this machine.

``EngineConfig`` holds what the user asked for; the engine starts from :func:`resolve_config`'s copy, in which
the target's and the draft's dtypes and weight formats and SSD's filler padding are concrete (each
``"auto"`` decided for the device that runs the model, by what that device computes fastest: ``ssd/dtypes.py``,
``ssd/models/weight_formats.py``). A format that cannot run where it was asked for is refused here, before
any model loads. Resolving a resolved configuration changes nothing.
"""

from __future__ import annotations

from dataclasses import replace

from ssd.config import EngineConfig
from ssd.dtypes import resolve_dtype
from ssd.models.loader import stores_blocks
from ssd.models.weight_formats import resolve_weight_format
from ssd.options import Dtype, FillerPadding


def resolve_config(config: EngineConfig) -> EngineConfig:
    """A copy of ``config`` with no ``"auto"`` dtype, weight format or filler padding left (``config`` itself
    is not changed)."""
    dtype = resolve_dtype(config.dtype, config.device)
    weight_format = resolve_weight_format(config.weight_format, config.device, dtype,
                                          explicit_dtype=config.dtype != Dtype.AUTO,
                                          stored_blocks=stores_blocks(config.model))
    spec = config.spec
    if spec is not None and spec.remote:  # the draft server resolves the draft's dtype and format for its device
        spec = replace(spec, filler_padding=resolve_filler_padding(spec.filler_padding, config.device))
    elif spec is not None:
        draft_device = spec.draft_device or config.device
        draft_dtype = resolve_dtype(spec.draft_dtype or config.dtype, draft_device)
        spec = replace(
            spec,
            draft_dtype=draft_dtype,
            draft_weight_format=resolve_weight_format(spec.draft_weight_format, draft_device, draft_dtype, draft=True,
                                                      stored_blocks=stores_blocks(spec.model)),
            filler_padding=resolve_filler_padding(spec.filler_padding, config.device),
        )
    return replace(config, dtype=dtype, weight_format=weight_format, speculative_config=spec)


def resolve_filler_padding(padding: FillerPadding | str, target_device: str) -> FillerPadding:
    """``"auto"``: random fillers repeat the pending token on CUDA, where a few more verified positions are
    nearly free, and stop at prompt lookup's copies on CPU, where each one costs the target time."""
    padding = FillerPadding.parse(padding, "filler_padding")
    if padding is FillerPadding.AUTO:
        return FillerPadding.REPEAT if str(target_device).startswith("cuda") else FillerPadding.NONE
    return padding
