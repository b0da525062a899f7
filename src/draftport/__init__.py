"""draftport: EAGLE-3 drafters — will speculation pay, can this drafter be reused, make it better, ship it."""

__version__ = "0.1.0"
