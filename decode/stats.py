"""Acceptance accounting. The accept-length histogram is the single source of truth:
alpha, tau and mean accepted length all derive from it and from per-position counts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SpeculativeStats:
    k: int
    proposed: int = 0
    """Draft tokens offered to the target (k per block, fewer near max_new_tokens)."""
    tried: int = 0
    """Draft tokens that reached the accept test (a block stops testing at its first rejection)."""
    accepted: int = 0
    """Draft tokens the target kept. The residual/bonus token is never counted here."""
    emitted: int = 0
    """Tokens returned to the caller (accepted + one residual or bonus per block, cut at EOS/max)."""
    target_forwards: int = 0
    """Target forward passes after the prompt prefill (one per block)."""
    looked_up: int = 0
    """Proposed tokens that came from prompt lookup instead of a draft forward."""
    draft_forwards: int = 0
    """Draft forward passes (one per drafted token for a draft LM; a feature draft also runs through
    looked-up tokens before drafting again)."""
    looked_up_accepted: int = 0
    """Of the accepted tokens, those that came from prompt lookup."""
    position_tried: list[int] = field(default_factory=list)
    """position_tried[i]: blocks whose draft token at position i reached the accept test."""
    position_accepted: list[int] = field(default_factory=list)
    accept_length_hist: list[int] = field(default_factory=list)
    """accept_length_hist[a]: blocks in which exactly a drafted tokens were accepted."""

    def __post_init__(self):
        if not self.position_tried:
            self.position_tried = [0] * self.k
            self.position_accepted = [0] * self.k
            self.accept_length_hist = [0] * (self.k + 1)

    def record_block(self, proposed: int, tried: int, accepted: int, emitted: int, draft_forwards: int,
                     looked_up: int = 0, looked_up_accepted: int = 0) -> None:
        """One verify pass: `proposed` drafted (`looked_up` of them by prompt lookup) in `draft_forwards`
        draft forwards, `tried` positions tested, the first `accepted` kept (`looked_up_accepted` of
        them looked up)."""
        self.proposed += proposed
        self.draft_forwards += draft_forwards
        self.looked_up += looked_up
        self.looked_up_accepted += looked_up_accepted
        self.tried += tried
        self.accepted += accepted
        self.emitted += emitted
        self.target_forwards += 1
        for i in range(tried):
            self.position_tried[i] += 1
        for i in range(accepted):
            self.position_accepted[i] += 1
        self.accept_length_hist[accepted] += 1

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted / proposed."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def token_acceptance(self) -> float:
        """accepted / tried: P(accept | reached), the empirical Σ min(target_probs, draft_probs)."""
        return self.accepted / self.tried if self.tried else 0.0

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward pass."""
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def draft_steps_per_forward(self) -> float:
        """Draft forwards per target forward: k without prompt lookup (fewer in the last block)."""
        return self.draft_forwards / self.target_forwards if self.target_forwards else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(accept at position i | reached position i)."""
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    def merge(self, other: SpeculativeStats) -> SpeculativeStats:
        """The counts of both (same k): every count field added, lists element by element."""
        assert other.k == self.k
        counts = {f.name: _add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self) if f.name != "k"}
        return SpeculativeStats(k=self.k, **counts)

    def to_dict(self) -> dict:
        """Every field, then the derived figures the reports show."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {name: getattr(self, name) for name in REPORTED}

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeStats:
        """The inverse of to_dict (derived figures are recomputed, not read)."""
        return cls(**{f.name: d[f.name] for f in fields(cls)})


# Derived figures written next to the counts by to_dict.
REPORTED = ("alpha", "token_acceptance", "tau", "per_position_acceptance")


def _add(a: int | list[int], b: int | list[int]) -> int | list[int]:
    return [x + y for x, y in zip(a, b)] if isinstance(a, list) else a + b


def expected_tau(alpha: float, k: int) -> float:
    """Tokens per target forward for i.i.d. acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(tau: float, draft_steps: float, c: float, r: float) -> float:
    """Speedup over target-only decoding: tau / (s*c + r(k)), with s = draft forwards per target
    forward (k without prompt lookup), c = draft/target step latency and r(k) = cost of one target
    forward over k+1 tokens / one decode step."""
    return tau / (draft_steps * c + r)
