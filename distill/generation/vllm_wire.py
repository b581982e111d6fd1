"""The messages between generate-data and its vLLM worker (vllm_worker.py).

The two run under different Python environments, so a message is a pickled dict of builtin types
only, with numpy arrays as raw bytes: neither side depends on the other's numpy or torch version.
Both ends are this project's own processes joined by a pipe, so unpickling trusts what it reads.

    generate-data -> worker   {"llm": {...vllm.LLM keyword arguments}}            once, first
    worker -> generate-data   {"ready": "<vLLM version>"} or {"error": "<one line>"}
    generate-data -> worker   {"generate": [{"prompt_ids", "seed"}, ...], "sampling": {...}, "teacher_topk": K}
                              or {"score": [{"prompt_ids", "completion_ids"}, ...], "teacher_topk": K}
    worker -> generate-data   {"completions": [{"ids", "topk_ids", "topk_logprobs"}, ...]} or {"error": ...}

Closing the worker's stdin ends it.
"""

from __future__ import annotations

import pickle

import numpy as np

PICKLE_PROTOCOL = 4  # readable by every Python either environment may run (3.8+)


def send(stream, message: dict) -> None:
    pickle.dump(message, stream, protocol=PICKLE_PROTOCOL)
    stream.flush()


def receive(stream) -> dict:
    """The next message; EOFError once the other side has closed the pipe."""
    return pickle.load(stream)


def pack(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


def unpack(packed: dict) -> np.ndarray:
    return np.frombuffer(packed["data"], dtype=np.dtype(packed["dtype"])).reshape(packed["shape"])
