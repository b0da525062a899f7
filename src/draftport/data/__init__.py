"""data: conversations, chat templates and prompts, and the on-disk hidden-state store."""
