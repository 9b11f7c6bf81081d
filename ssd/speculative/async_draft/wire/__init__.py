"""What the target and the draft process say to each other: framing, typed messages and the protocol."""
