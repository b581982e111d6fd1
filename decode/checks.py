"""Argument checks for the decode entry points: clear errors before a runner is built or a token decoded.

Unchecked, a bad argument fails deep inside a forward or, worse, silently: a prompt id of -5
indexes the embedding from its end (token 49,147 of SmolLM2's 49,152), and k = 2.5 runs
blocks of 2 and 3 tokens alternately.
"""

from __future__ import annotations

import numbers

import torch


def check_int(name: str, value, minimum: int) -> None:
    """`value` is an int (not a bool) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def prompt_ids(input_ids, vocab_size: int) -> list[int]:
    """The prompt of input_ids, a LongTensor [1, L] of ids in [0, vocab_size), as a list."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        got = f"a {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(f"input_ids must be a torch.LongTensor of shape [1, L], got {got}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, L], got {list(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: at least one prompt token is needed")
    ids = input_ids[0].tolist()
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the target's vocabulary), got {outside[0]}")
    return ids


def check_context(prompt_len: int, max_new_tokens: int, max_lengths: list[int | None]) -> None:
    """The prompt and every new token fit each model's context (None: no limit)."""
    needed = prompt_len + max_new_tokens
    for max_length in max_lengths:
        if max_length is not None and needed > max_length:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the model's context of {max_length} tokens")
