"""What the driver rank broadcasts to tensor-parallel worker ranks, one command per collective round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ssd.runtime.forward_items import ForwardItem


@dataclass
class ForwardCommand:
    """Run one forward pass on these items (the driver runs the same pass on its shard)."""

    items: list[ForwardItem]


@dataclass
class ShutdownCommand:
    """Leave the worker loop and exit."""
