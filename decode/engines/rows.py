"""What every engine hands back (EngineRun: one mode at one temperature over the prompts) and the
report rows made from them: tokens/s, speedup over the same engine's plain decoding, acceptance,
whether greedy output equals that engine's plain greedy output, and how likely the target finds
the output."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineRun:
    engine: str
    prompt_set: str
    mode: str
    """plain: the target alone; draft: our exported draft; ngram: the engine's own n-gram / prompt lookup."""
    k: int | None
    """Draft length (None for plain decoding)."""
    temperature: float
    new_tokens: list[int]
    """Per prompt: tokens generated."""
    seconds: list[float]
    """Per prompt: decoding time (wall-clock around the engine's generate call, or the engine's own
    decode timer where its process also loads models); at batch > 1 each request's latency, from joining
    to its last token."""
    outputs: list
    """Per prompt: the generated token ids, or text where the engine prints only text."""
    accepted: int | None = None
    """Drafted tokens the target accepted, over all prompts (None: the engine does not say)."""
    drafted: int | None = None
    """Tokens drafted, over all prompts."""
    notes: list[str] = field(default_factory=list)
    target_logprob: float | None = None
    """The target's mean log-probability per output token (decode/engines/target_logprob.py)."""
    batch: int = 1
    """1: one prompt at a time; B > 1: the serving requests (EngineJob.requests) with up to B in flight."""
    wall_s: float | None = None
    """At batch > 1: wall-clock seconds for all requests together."""

    @property
    def tok_s(self) -> float:
        return sum(self.new_tokens) / (self.wall_s if self.batch > 1 else sum(self.seconds))

    @property
    def tau(self) -> float | None:
        """Tokens per target forward: each forward yields its accepted drafted tokens plus one of its own."""
        if self.accepted is None:
            return None
        forwards = sum(self.new_tokens) - self.accepted
        return sum(self.new_tokens) / forwards if forwards > 0 else None

    @property
    def alpha(self) -> float | None:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.accepted is not None and self.drafted else None


def outputs_agree(a, b) -> bool:
    """Two outputs (token ids or text) equal over their common length. Engines that verify k tokens at
    a time may stop up to k tokens past the requested count (llama.cpp's speculative tools do); an output that
    stopped early at EOS is the common length itself."""
    n = min(len(a), len(b))
    return list(a[:n]) == list(b[:n]) and (n > 0 or len(a) == len(b))


def engine_rows(runs: list[EngineRun]) -> list[dict]:
    """One report row per run; speedup is against the same engine's plain run at the same prompt set,
    temperature and batch size, and the greedy check against its plain greedy run at batch 1 (request i of a
    batched run is prompt i % n) (None where there is none)."""
    plain = {(r.engine, r.prompt_set, r.temperature, r.batch): r for r in runs if r.mode == "plain"}
    rows = []
    for run in runs:
        base = plain.get((run.engine, run.prompt_set, run.temperature, run.batch))
        reference = plain.get((run.engine, run.prompt_set, 0.0, 1))
        greedy = None
        if run.temperature == 0 and run is not reference and reference is not None:
            greedy = all(outputs_agree(output, reference.outputs[i % len(reference.outputs)])
                         for i, output in enumerate(run.outputs))
        rows.append({"engine": run.engine, "prompt_set": run.prompt_set, "mode": run.mode, "k": run.k,
                     "temperature": run.temperature, "batch": run.batch,
                     "n_prompts": len(run.new_tokens), "new_tokens": sum(run.new_tokens), "tok_s": run.tok_s,
                     "speedup": run.tok_s / base.tok_s if base is not None else None,
                     "mean_latency_s": sum(run.seconds) / len(run.seconds),
                     "alpha": run.alpha, "tau": run.tau, "greedy_identical": greedy,
                     "target_logprob": run.target_logprob, "notes": run.notes})
    return rows
