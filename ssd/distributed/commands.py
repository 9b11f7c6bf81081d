"""What the driver rank broadcasts to tensor-parallel worker ranks, one command per collective round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ssd.runtime.forward_items import ForwardItem


@dataclass
class ForwardCommand:
    """Run one forward pass on these items (the driver runs the same pass on its shard). ``eager``: through the
    layers one by one, never a captured graph (the driver's pass takes the target's features)."""

    items: list[ForwardItem]
    eager: bool = False


@dataclass
class ShutdownCommand:
    """Leave the worker loop and exit."""
