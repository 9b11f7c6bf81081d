"""How the draft process plans its cache builds: fan-out policies and budgets, acceptance estimates and calibration,
the fallback choice and when a build ends."""
