"""train: hidden-state capture, the TTT training loop, losses, distributed helpers and checkpoints."""
