"""check: is a drafter drop-in for a target and an engine (configs, tensor inventories, layer rules); no torch."""
