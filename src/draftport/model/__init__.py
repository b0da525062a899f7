"""model: the EAGLE-3 drafter, its vocabulary map, checkpoint layouts, the target wrapper and fused regions."""
