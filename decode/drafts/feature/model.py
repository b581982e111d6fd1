"""A feature-level draft (EAGLE-3 style): one decoder layer at the target's width that reads the target's
own hidden states instead of re-deriving them from tokens.

At draft position i the layer reads two things:
  - a hidden state: at positions the target has verified, `fc` of the target's hidden states of a few
    layers at i (low / middle / high, concatenated); at positions the draft itself proposed, its own
    output (pre-norm) at i - 1;
  - the target's input embedding of token i + 1 (the target's embedding matrix, reused, not owned);
and predicts token i + 2 over its own vocabulary subset (`draft_ids`: the target id of each head row).

Shapes and names follow the EAGLE-3 layout vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`/`t2d` at export): the embedding and the hidden state are each RMS-normed and concatenated, so
q/k/v read 2 x hidden; the residual is the hidden state; the output before the final norm is the next
step's hidden state.

Training unrolls the draft on its own hidden states (EAGLE-3's "training-time test", `unrolled`):
step j at position i stands for "the target verified up to i - j, the draft proposed the rest", and
attends to step-0 keys up to i - j and to its own earlier steps' keys on the diagonal, exactly the
keys a decode-time cache holds in that situation (`FeatureDraftCache`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from common.errors import UserError
from decode.runners.llama import RotaryTable


CONFIG_FILE = "feature_draft.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class FeatureDraftConfig:
    hidden_size: int
    """The target's width (the draft reads and writes the target's residual stream)."""
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_layers: list[int]
    """The target's decoder layers whose outputs are read (0-based, as decode.runners' hidden_layers)."""
    vocab_size: int
    """The target's vocabulary."""
    draft_vocab_size: int
    """Rows of the draft's head (its vocabulary subset)."""
    target_num_layers: int | None = None
    """The target's decoder layers, to refuse another target of the same width (None: not recorded)."""

    @classmethod
    def for_target(cls, target_config, target_layers: list[int], intermediate_size: int,
                   draft_vocab_size: int) -> FeatureDraftConfig:
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=target_config.hidden_size, intermediate_size=intermediate_size,
            num_attention_heads=heads, num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(getattr(target_config, "rope_theta", None)
                             or target_config.rope_parameters["rope_theta"]),
            max_position_embeddings=target_config.max_position_embeddings,
            target_layers=list(target_layers), vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size, target_num_layers=target_config.num_hidden_layers)


def default_target_layers(num_layers: int) -> list[int]:
    """Low, middle and high layers, as EAGLE-3 reads them (vLLM's default aux layers 2, L/2, L-3 are
    layer *inputs*: the outputs of layers 1, L/2 - 1 and L - 4)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


class FeatureDraft(nn.Module):
    """The draft's weights and its forward; the target's embedding is passed in, never stored."""

    def __init__(self, config: FeatureDraftConfig, draft_ids: torch.Tensor):
        super().__init__()
        c = config
        if draft_ids.shape != (c.draft_vocab_size,):
            raise ValueError(f"draft_ids has shape {tuple(draft_ids.shape)}, expected ({c.draft_vocab_size},)")
        in_vocab = 0 <= int(draft_ids.min()) and int(draft_ids.max()) < c.vocab_size
        if draft_ids.unique().numel() != c.draft_vocab_size or not in_vocab:
            raise ValueError(f"draft_ids must be {c.draft_vocab_size} distinct target ids in [0, {c.vocab_size})")
        self.config = c
        width, q_width, kv_width = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.fc = nn.Linear(len(c.target_layers) * width, width, bias=False)
        self.embed_norm = nn.RMSNorm(width, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(width, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * width, q_width, bias=False)
        self.k_proj = nn.Linear(2 * width, kv_width, bias=False)
        self.v_proj = nn.Linear(2 * width, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, width, bias=False)
        self.post_norm = nn.RMSNorm(width, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(width, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, width, bias=False)
        self.norm = nn.RMSNorm(width, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(width, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", draft_ids.long().clone(), persistent=True)

    def num_params(self) -> int:
        """Every weight the draft adds to the target (the reused target embedding not counted)."""
        return sum(p.numel() for p in self.parameters())

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [..., len(target_layers), hidden] -> the draft's input hidden [..., hidden]."""
        return self.fc(target_hidden.flatten(-2).to(self.fc.weight.dtype))

    def rope(self, capacity: int) -> RotaryTable:
        """Rotary cos/sin of positions 0..capacity-1. The frequencies are computed here in fp32, as the HF
        Llama and vLLM compute theirs, not kept as a buffer a bf16 cast would round."""
        c = self.config
        dims = torch.arange(0, c.head_dim, 2, device=self.fc.weight.device).float()
        return RotaryTable(1.0 / c.rope_theta ** (dims / c.head_dim), capacity, self.fc.weight.dtype)

    def qkv(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., T, H, D] and k, v [..., T, KV, D] (q, k rotated) from the hidden state and the embedding."""
        c = self.config
        x = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)  # [..., T, 2 hidden]
        q = self.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim))
        k = self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        rotate = lambda t: t * cos + t.roll(c.head_dim // 2, dims=-1) * sin  # noqa: E731 (RotaryTable's signed sin)
        return rotate(q), rotate(k), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual (the input hidden state) + attention output + MLP -> the output hidden state (pre-norm)."""
        x = hidden + self.o_proj(attn)
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output hidden states [..., hidden] -> fp32 logits [..., draft_vocab_size] over the subset rows."""
        return self.lm_head(self.norm(out)).float()

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[..., KV, D] -> [..., H, D]: each key/value head shared by H / KV query heads."""
        return t.repeat_interleave(self.config.num_attention_heads // self.config.num_key_value_heads, dim=-2)

    def unrolled(self, target_hidden: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training forward: `steps` draft steps at every position at once.

        target_hidden [B, T, len(target_layers), hidden]: the target's hidden states at positions 0..T-1;
        embeds [B, T, hidden]: the embedding of token i + 1 at position i. Returns the output hidden
        states [B, T, hidden] of each step; step j's output at i predicts token i + 2 having read the
        target's features only up to i - j (positions i < j have no such context: mask their loss)."""
        B, T, _ = embeds.shape
        cos, sin = self.rope(T).at(slice(0, T))  # [T, 1, D]
        hidden = self.fuse(target_hidden)
        keys, values, outs = [], [], []
        for j in range(steps):
            q, k, v = self.qkv(hidden, embeds, cos, sin)
            keys.append(self.expand_kv(k))
            values.append(self.expand_kv(v))
            attn = unrolled_attention(q, keys, values)  # [B, T, H * D]
            out = self.finish(hidden, attn)
            outs.append(out)
            hidden = F.pad(out[:, :-1], (0, 0, 1, 0))  # step j + 1 at i reads step j's output at i - 1
        return outs

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: t.contiguous() for name, t in self.state_dict().items()}, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path | str, device: torch.device | str = "cpu") -> FeatureDraft:
        folder = Path(folder)
        config = FeatureDraftConfig(**json.loads((folder / CONFIG_FILE).read_text()))
        state = load_file(str(folder / WEIGHTS_FILE), device=str(device))
        model = cls(config, state["draft_ids"]).to(device=device, dtype=state["fc.weight"].dtype)
        model.load_state_dict(state)
        return model.eval()


def is_feature_draft(folder: Path | str) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


def feature_draft_problem(folder: Path | str) -> str | None:
    """Why `folder` is not a loadable feature draft (None: it looks complete), found without loading it."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"feature draft folder {str(folder)!r} does not exist"
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    return f"feature draft folder {str(folder)!r} has no {' or '.join(missing)}" if missing else None


class FeatureDraftMismatch(UserError):
    """A feature draft paired with a target it was not trained on."""


def check_target(config: FeatureDraftConfig, target_config, target_vocab_size: int) -> None:
    """Refuse a target whose hidden states this draft cannot read: another width, layer count or
    vocabulary, or no layer for an id in target_layers. One line naming every difference."""
    layers = target_config.num_hidden_layers
    problems = []
    if config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {config.hidden_size} vs the target's {target_config.hidden_size}")
    if config.target_num_layers is not None and config.target_num_layers != layers:
        problems.append(f"trained on a {config.target_num_layers}-layer target, this one has {layers}")
    outside = [i for i in config.target_layers if not 0 <= i < layers]
    if outside:
        problems.append(f"reads layers {outside} of a target with layers 0..{layers - 1}")
    if config.vocab_size != target_vocab_size:
        problems.append(f"vocabulary of {config.vocab_size} ids vs the target's {target_vocab_size}")
    if problems:
        raise FeatureDraftMismatch("this feature draft does not fit the target: " + "; ".join(problems))


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step j = len(keys) - 1 of the unrolled forward. q [B, T, H, D]; keys/values [B, T, H, D] of steps 0..j.

    Query i attends to step-0 keys at positions <= i - j (the context the target verified) and to the
    key of step s >= 1 at position i - j + s (the draft's own earlier proposals in that scenario; s = j
    is position i itself, so every query has at least one key)."""
    j = len(keys) - 1
    B, T, H, D = q.shape
    scale = D ** -0.5
    qh = q.transpose(1, 2)  # [B, H, T, D]
    scores0 = qh @ keys[0].transpose(1, 2).transpose(-1, -2) * scale  # [B, H, T, T]
    i = torch.arange(T, device=q.device)
    visible = i[None, :] <= i[:, None] - j  # [T, T]: key p visible to query i
    scores0 = scores0.masked_fill(~visible, float("-inf"))
    diagonal_scores, diagonal_values = [], []
    for s in range(1, j + 1):
        shift = j - s  # key position i - shift
        k_s = F.pad(keys[s][:, : T - shift], (0, 0, 0, 0, shift, 0))  # [B, T, H, D] aligned to queries
        v_s = F.pad(values[s][:, : T - shift], (0, 0, 0, 0, shift, 0))
        score = (q * k_s).sum(-1).transpose(1, 2) * scale  # [B, H, T]
        diagonal_scores.append(score.masked_fill(i < shift, float("-inf")).unsqueeze(-1))
        diagonal_values.append(v_s.transpose(1, 2))  # [B, H, T, D]
    probs = torch.softmax(torch.cat([scores0, *diagonal_scores], dim=-1), dim=-1)  # [B, H, T, T + j]
    out = probs[..., :T] @ values[0].transpose(1, 2)  # [B, H, T, D]
    for s, v_s in enumerate(diagonal_values):
        out = out + probs[..., T + s : T + s + 1] * v_s
    return out.transpose(1, 2).flatten(-2)  # [B, T, H * D]


class FeatureDraftCache:
    """Batch-1 decoding: the draft's keys and values by position, rolled back by length.

    `forward(hidden, embeds)` runs positions length..length+n-1 (causal among themselves, over every
    cached position before them) and returns their output hidden states [n, hidden]."""

    def __init__(self, model: FeatureDraft, capacity: int | None = None):
        self.model = model
        c = model.config
        self.capacity = capacity or c.max_position_embeddings
        self.rope = model.rope(self.capacity)
        dtype, device = model.fc.weight.dtype, model.fc.weight.device
        self.keys = torch.zeros(self.capacity, c.num_attention_heads, c.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """hidden, embeds [n, hidden] into slots length..length+n-1 -> output hidden states [n, hidden].
        By default slot = position and causal; a draft tree (decode/tree_proposers.py) gives each row's
        rotary position [n] and the slots it attends, visible [n, length + n]."""
        n, start = hidden.shape[0], self.length
        if start + n > self.capacity:
            raise ValueError(f"position {start + n - 1} is beyond the draft's context of {self.capacity}")
        m = self.model
        cos, sin = self.rope.at(slice(start, start + n) if positions is None else positions)
        q, k, v = m.qkv(hidden, embeds, cos, sin)  # [n, H, D], [n, KV, D]
        self.keys[start : start + n] = m.expand_kv(k)
        self.values[start : start + n] = m.expand_kv(v)
        self.length = start + n
        keys, values = self.keys[: self.length].transpose(0, 1), self.values[: self.length].transpose(0, 1)
        # Query t (position start + t) sees every cached position up to its own (one query: all of them).
        if visible is None and n > 1:
            slots = torch.arange(self.length, device=q.device)
            visible = slots[None, :] <= slots[start : start + n, None]  # [n, length]
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible)  # [H, n, D]
        return m.finish(hidden, attn.transpose(0, 1).flatten(-2))
