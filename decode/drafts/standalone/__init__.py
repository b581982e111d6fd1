"""A standalone draft: a small language model of its own, sampled one token at a time."""
