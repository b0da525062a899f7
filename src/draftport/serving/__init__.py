"""Real serving engines as backends: what users serve with, driven by draftport."""
