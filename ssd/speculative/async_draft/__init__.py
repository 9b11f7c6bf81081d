"""SSD (speculative speculative decoding): the draft process (worker, draft engine, tree), its client on the
target's side, its plans (``planning``) and the messages between them (``wire``)."""
