"""The EAGLE-3 training script trains what the engine runs: its training-time-test forward (step j, row p) gives
the logits the engine's head gives when it drafts the (j+1)-th token after catching up to row p, and its export
loads with ``method="eagle3"``'s loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ssd.models.attention_layout import (
    SequenceLayout,
    block_slots,
    build_attention_metadata,
)
from ssd.models.eagle3 import load_eagle3_head
from ssd.models.loader import load_arch_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
import eagle3_head  # noqa: E402


def _head_rows(head, caches, table, start: int, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    end = start + len(tokens)
    meta = build_attention_metadata([SequenceLayout(block_slots(table, 4, start, end), block_slots(table, 4, 0, end))])
    with torch.no_grad():
        return head(torch.tensor(tokens), features, torch.arange(start, end), meta, caches)


def test_training_time_test_is_the_engines_drafting(checkpoint_factory, tmp_path):
    target = Path(checkpoint_factory(arch="llama", num_layers=8))
    cfg = json.loads((target / "config.json").read_text())
    cfg.setdefault("rope_theta", 10000.0)
    state = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    draft_ids = torch.arange(0, cfg["vocab_size"], 3)
    trainer = eagle3_head.HeadTrainer(cfg, state, draft_ids)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.p.values():  # nothing left at its initial value, and exactly representable in float16
            p.add_(0.05 * torch.randn(p.shape, generator=gen)).copy_(p.half().float())
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"params": dict(trainer.p.items()), "draft_ids": draft_ids, "cfg": cfg, "step": 0}, run / "head.pt")
    eagle3_head.stage_export(tmp_path, "run", tmp_path / "head")

    head, layers = load_eagle3_head(tmp_path / "head", load_arch_config(target),
                                    target_embedding=state["model.embed_tokens.weight"])
    assert layers == (2, 4, 5)
    steps, rows = 3, 9
    tokens = torch.randint(3, cfg["vocab_size"], (rows + steps,), generator=gen)
    feats = torch.randn(rows + steps, 3 * cfg["hidden_size"], generator=gen)
    with torch.no_grad():
        trained = [lg[0] for lg in trainer(tokens[None], feats[None], steps)]  # step j: [rows, Vd]

    p = 5  # catch up over rows 0..p with the target's features, then draft on the head's own
    caches, table = head.allocate_kv_caches(8, 4), [6, 1, 4, 7]
    out = _head_rows(head, caches, table, 0, tokens[1 : p + 2].tolist(), head.fuse(feats[: p + 1]))
    torch.testing.assert_close(head.compute_logits(out), trained[0][: p + 1], rtol=1e-4, atol=1e-4)
    feature = out[-1:]
    for j in range(1, steps):
        feature = _head_rows(head, caches, table, p + j, [int(tokens[p + 1 + j])], feature)
        torch.testing.assert_close(head.compute_logits(feature)[0], trained[j][p], rtol=1e-4, atol=1e-4)
