"""The draft's training prompts (train/prompt_gen.py): no evaluation prompt leaks in, and the generation
order keeps every earlier prompt's index (the validation split is by index)."""

import random
import re
import sys
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parent.parent / "train"
if str(TRAIN) not in sys.path:
    sys.path.insert(0, str(TRAIN))

from eval_prompts import CHAT_EVAL, CODE_EVAL  # noqa: E402
from prompt_gen import EVAL_STUB_NAMES, all_prompts, generation_order  # noqa: E402


@pytest.fixture(scope="module")
def prompts():
    return all_prompts()


def test_no_evaluation_prompt_is_trained_on(prompts):
    chat = {p.strip().lower() for p in prompts.chat}
    assert not chat & {p.strip().lower() for p in CHAT_EVAL}
    stubs = prompts.stubs + prompts.doc_stubs
    assert not set(stubs) & set(CODE_EVAL)
    names = {m.group(1) for s in stubs for m in [re.search(r"^def (\w+)\(", s, re.MULTILINE)] if m}
    assert names and not names & EVAL_STUB_NAMES


def test_doc_stubs_have_the_humaneval_shape(prompts):
    assert len(prompts.doc_stubs) > 100
    for stub in prompts.doc_stubs:
        sig = re.search(r"^def \w+\(.*\).*:\n    \"\"\"", stub, re.MULTILINE)
        assert sig is not None, stub
        assert stub.endswith('\n    """\n') and stub.count('"""') == 2
        doc = stub[sig.end():]
        assert "\n\n" in doc or ">>>" in doc  # more than the first paragraph
    assert not set(prompts.doc_stubs) & set(prompts.stubs)


def test_generation_order_appends_without_moving_earlier_prompts(prompts):
    chat, stubs, docs = prompts.chat, prompts.stubs, prompts.doc_stubs
    order = generation_order(chat, stubs, docs)
    earlier = chat + stubs
    random.Random(0).shuffle(earlier)  # the order the data of drafts up to v5 was generated in
    assert order[: len(earlier)] == earlier
    assert sorted(order[len(earlier):]) == sorted(docs)
    assert generation_order(chat, stubs, docs) == order  # deterministic


def test_user_turn_prefix_ends_where_the_message_begins(tmp_path):
    from checkpoints import make_tokenizer
    from make_data import user_turn_prefix

    from ssd.tokenizer import Tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    tok = Tokenizer(str(tmp_path))
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert full[: len(prefix)] == prefix
    # special tokens included, nothing of the message
    assert tok.decode(prefix, skip_special_tokens=False) == "<|im_start|>user\n"


def test_select_requests_keeps_closed_new_requests_once():
    from make_data import select_requests

    samples = [
        ("  How do tides work?\n", "stop", 6),
        ("How do tides work?", "stop", 5),  # a duplicate
        ("how do tides WORK?", "stop", 5),  # a duplicate up to case
        ("Tell me about the", "length", 64),  # the target never closed its turn
        ("Hi", "stop", 1),  # too short
        (CHAT_EVAL[0].upper(), "stop", 12),  # an evaluation prompt
        ("Name three rivers.", "stop", 5),
    ]
    assert select_requests(samples, CHAT_EVAL) == ["How do tides work?", "Name three rivers."]
