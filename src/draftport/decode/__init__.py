"""decode: lossless speculative decoding (engine, sampling, offline replay) and its eval/generate verbs."""
