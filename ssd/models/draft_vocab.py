"""Reduced draft vocabularies: a draft that predicts only a subset of the target's tokens.

The draft's LM head (often its most expensive layer when many SSD tree branches are decoded at once) then
covers only the tokens it is likely to propose. A checkpoint folder opts in with ``draft_vocab.json``::

    {"target_vocab_size": 49152, "draft_to_target": [t_0, t_1, ...], "unknown_id": u}

Draft id i stands for target id ``draft_to_target[i]``; ``unknown_id`` (whose entry is -1) is the input id of
every target token outside the subset. Exactness is unaffected: tokens the draft cannot produce get q = 0,
and verification simply never accepts a draft it did not make.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILENAME = "draft_vocab.json"


@dataclass
class DraftVocab:
    target_vocab_size: int
    draft_to_target: np.ndarray  # [Vd] int64, -1 for the unknown id
    unknown_id: int

    def __post_init__(self) -> None:
        d2t = np.asarray(self.draft_to_target, dtype=np.int64)
        self.draft_to_target = d2t
        if not 0 <= self.unknown_id < d2t.size or d2t[self.unknown_id] != -1:
            raise ValueError(f"draft vocabulary: unknown_id {self.unknown_id} must index an entry equal to -1")
        valid = np.delete(d2t, self.unknown_id)
        if valid.size and (valid.min() < 0 or valid.max() >= self.target_vocab_size):
            raise ValueError(f"draft vocabulary maps to ids outside [0, {self.target_vocab_size})")
        if np.unique(valid).size != valid.size:
            raise ValueError("draft vocabulary lists a target id twice")

    @property
    def size(self) -> int:
        return int(self.draft_to_target.size)

    def target_to_draft(self) -> np.ndarray:
        """[V_target] int64: the draft input id of every target id."""
        table = np.full(self.target_vocab_size, self.unknown_id, dtype=np.int64)
        ids = np.arange(self.size)
        known = self.draft_to_target >= 0
        table[self.draft_to_target[known]] = ids[known]
        return table

    @classmethod
    def load(cls, folder: str | Path) -> "DraftVocab | None":
        path = Path(folder) / FILENAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(int(data["target_vocab_size"]), np.asarray(data["draft_to_target"]), int(data["unknown_id"]))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"invalid {path}: {exc}") from exc

    def save(self, folder: str | Path) -> None:
        data = {
            "target_vocab_size": self.target_vocab_size,
            "draft_to_target": self.draft_to_target.tolist(),
            "unknown_id": self.unknown_id,
        }
        (Path(folder) / FILENAME).write_text(json.dumps(data), encoding="utf-8")
