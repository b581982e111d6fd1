"""Build the draft: from scratch in the target's family, sized by a parameter ratio, or from a
pretrained model sharing the tokenizer (optionally LoRA). Also the choice of a vocabulary subset.

Shape search (scratch): depth is fixed (shallow: 2 layers by default, since a draft step's
latency grows with depth, not width); the hidden size is the candidate whose parameter count
(embeddings included, tied head) is closest to param_ratio x target parameters. Heads keep the
target's head_dim (or fewer dims when the draft is narrower), KV heads keep its GQA ratio, and
the MLP keeps its intermediate/hidden ratio. E.g. SmolLM2-135M at 2% with the full 49,152-token
vocabulary: hidden 64, 2 layers -> 3.2M params (2.4%); embeddings dominate, which is why a
vocabulary subset (e.g. 8,192 tokens) buys width.

Vocabulary subset (vocab_subset = N): the N most frequent tokens of the training data (special
tokens always in). Embedding and tied head have N + 1 rows; row N ("other") stands for every
token outside the subset on input, and on output for each of them (spread_other, what training
builds now: decode/vocab.py), so a full-vocabulary copy of the draft gives the same distribution.
The row <-> id map is a decode.vocab.VocabSubset, written into the draft's HF config by its `write_to`.

Factored outside rows (outside_rank = r): r more head rows and a [V - N, r] factor give every outside token
a logit of its own (decode/vocab.py); they count in the parameter budget (an 8,192-token subset of SmolLM2 at
r = 8 adds 41k x 8 = 328k factors + 8 rows), so the layers get narrower where they do not fit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.models import param_count
from common.outside_factors import attach_outside_factors
from decode.vocab import VocabSubset


@dataclass
class DraftShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    vocab_rows: int
    params: int
    ratio: float


def select_vocab(token_counts: torch.Tensor, size: int, always: list[int]) -> list[int]:
    """The `size` most frequent ids (ties: lower id first), `always` included; sorted by id.

    token_counts [V]: occurrences of each full-vocabulary id in the training data."""
    always = sorted(set(always))
    if size < len(always):
        raise ValueError(f"vocab_subset={size} cannot hold the {len(always)} special tokens")
    counts = token_counts.clone().double()
    counts[always] = float("inf")
    # stable sort: equal counts keep ascending id order
    order = torch.sort(-counts, stable=True).indices[:size]
    seen = int((token_counts > 0).sum())
    if seen < size:
        warnings.warn(f"vocab_subset={size} but the data holds only {seen} distinct tokens; "
                      f"{size - seen} rows are filled with unseen ids")
    return sorted(order.tolist())


def _shape_config(target_config, hidden: int, num_layers: int, vocab_rows: int) -> LlamaConfig | None:
    """The draft config of width `hidden`, or None when whole heads cannot tile that width."""
    target_head_dim = getattr(target_config, "head_dim", None) or (
        target_config.hidden_size // target_config.num_attention_heads)
    head_dim = min(target_head_dim, hidden)
    heads = max(1, hidden // head_dim)
    if heads * head_dim != hidden:
        return None
    gqa = max(1, target_config.num_attention_heads // target_config.num_key_value_heads)
    kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // gqa))
    mlp_ratio = target_config.intermediate_size / target_config.hidden_size
    intermediate = max(16, int(round(hidden * mlp_ratio / 16)) * 16)
    return LlamaConfig(
        vocab_size=vocab_rows, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps, rope_parameters=getattr(target_config, "rope_parameters", None),
        tie_word_embeddings=True, bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id, pad_token_id=target_config.pad_token_id)


def _meta_params(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return param_count(LlamaForCausalLM(config))


def choose_shape(target_config, target_params: int, param_ratio: float, num_layers: int,
                 vocab_rows: int, extra_params: int = 0) -> tuple[LlamaConfig, DraftShape]:
    """The draft config whose parameter count (+ extra_params held outside the Llama: factored outside
    rows) is closest to param_ratio x target_params."""
    if not 0.01 <= param_ratio <= 0.03:
        warnings.warn(f"param_ratio={param_ratio:.3f} is outside the usual 1-3% of the target's parameters")
    budget = param_ratio * target_params
    step = 16 if target_config.hidden_size < 256 else 32
    best = None
    hidden = step
    while True:
        config = _shape_config(target_config, hidden, num_layers, vocab_rows)
        if config is not None:
            params = _meta_params(config) + extra_params
            if best is None or abs(params - budget) < abs(best[1] - budget):
                best = (config, params)
            if params > budget:
                break
        hidden += step
    config, params = best
    shape = DraftShape(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim, num_layers, vocab_rows, params,
                       params / target_params)
    if not 0.01 <= shape.ratio <= 0.03:
        warnings.warn(f"the draft has {shape.ratio:.2%} of the target's parameters (usual: 1-3%)")
    return config, shape


@torch.no_grad()
def project_embeddings(target_embed: torch.Tensor, width: int, rows: torch.Tensor | None,
                       init_std: float, generator: torch.Generator) -> torch.Tensor:
    """Low-rank projection of the target's embedding matrix onto `width` dims.

    target_embed [V, H]. The projection basis is the top right-singular vectors of the
    (subset) rows, from an eigendecomposition of the H x H Gram matrix (cheap: H = 576 for
    SmolLM2). Inner products between token embeddings, which the tied head turns into logits,
    are preserved as well as `width` dims allow. With a subset, one extra "other" row is the
    mean of the projected rows outside it. Dims beyond H (a draft wider than the target) are
    random (std init_std). Returns [len(rows) (+1), width] or [V, width]."""
    embed = target_embed.float()
    chosen = embed if rows is None else embed[rows]  # [N, H]
    keep = min(width, embed.shape[1])
    basis = _projection_basis(chosen, keep)
    out = torch.randn(chosen.shape[0], width, generator=generator) * init_std
    out[:, :keep] = chosen @ basis
    if rows is None:
        return out
    outside = torch.ones(embed.shape[0], dtype=torch.bool)
    outside[rows] = False
    other = torch.randn(1, width, generator=generator) * init_std
    if outside.any():
        other[:, :keep] = (embed[outside] @ basis).mean(0, keepdim=True)
    return torch.cat([out, other])


def _projection_basis(rows: torch.Tensor, keep: int) -> torch.Tensor:
    """[H, keep]: the top right-singular vectors of rows [N, H], largest first, from the eigendecomposition
    of the H x H Gram matrix (cheap: H = 576 for SmolLM2)."""
    _, vectors = torch.linalg.eigh(rows.T @ rows)  # ascending eigenvalues
    return vectors[:, -keep:].flip(-1)


@torch.no_grad()
def factor_outside_rows(target_embed: torch.Tensor, width: int, subset: VocabSubset, init_std: float,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial basis rows P [r, width] and factors U [V - N, r] of factored outside rows: the best rank-r fit
    (truncated SVD) of the outside tokens' projected target embeddings (as project_embeddings projects the
    subset's) less their mean, the "other" row. At step 0 outside token j's head row w_other + U_j P is then
    close to its own projected embedding, as the subset rows are. Dims beyond the target's are random."""
    embed = target_embed.float()
    keep = min(width, embed.shape[1])
    outside = embed[subset.outside_ids.cpu()] @ _projection_basis(embed[subset.ids.cpu()], keep)  # [V - N, keep]
    u, s, vt = torch.linalg.svd(outside - outside.mean(0), full_matrices=False)
    rank = subset.outside_rank
    root = s[:rank].sqrt()
    rows = torch.randn(rank, width, generator=generator) * init_std
    rows[:, :keep] = root[:, None] * vt[:rank]
    return rows, u[:, :rank] * root


def add_outside_rows(draft: LlamaForCausalLM, rank: int, seed: int) -> None:
    """Factored outside rows for a spread subset draft without them (distill.init from a trained draft): r
    random basis rows after its "other" row and U = 0, so it starts from exactly its own distribution."""
    subset = VocabSubset.of(draft, "cpu")
    if subset is None or not subset.spread_other:
        raise ValueError("factored outside rows (distill.outside_rank) need a vocabulary-subset draft trained with "
                         "distill.spread_other=true")
    if subset.factored:
        if subset.outside_rank != rank:
            raise ValueError(f"the draft already has {subset.outside_rank} factored outside rows, not {rank}")
        return
    generator = torch.Generator().manual_seed(seed)
    embed = draft.get_input_embeddings().weight
    rows = torch.randn(rank, embed.shape[1], generator=generator) * draft.config.initializer_range
    factored = VocabSubset(subset.ids, subset.full_vocab_size, "cpu", True, rank)
    draft.resize_token_embeddings(factored.head_rows, mean_resizing=False)  # tied: the head grows with it
    draft.get_input_embeddings().weight.data[subset.head_rows:] = rows.to(embed.dtype)
    attach_outside_factors(draft, torch.zeros(len(factored.outside_ids), rank, dtype=embed.dtype))
    factored.write_to(draft.config)


def build_scratch_draft(target, param_ratio: float, num_layers: int, subset: VocabSubset | None,
                        embed_init: str, seed: int) -> tuple[LlamaForCausalLM, DraftShape]:
    """A fresh Llama draft sized to the target. subset: the tokens it emits (on the CPU), or None
    for the target's full vocabulary."""
    full_vocab = target.get_input_embeddings().weight.shape[0]
    if subset is not None and subset.full_vocab_size != full_vocab:
        raise ValueError(f"the subset maps into {subset.full_vocab_size} ids, the target has {full_vocab}")
    # The "other" row is there whether or not the decoder scores it (an old draft's is the outside mass).
    vocab_rows = subset.size + 1 + subset.outside_rank if subset is not None else full_vocab
    extra = subset.outside_params if subset is not None else 0
    config, shape = choose_shape(target.config, param_count(target), param_ratio, num_layers, vocab_rows, extra)
    if subset is not None:
        subset.write_to(config)
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    if embed_init not in ("target", "random"):
        raise ValueError(f"embed_init={embed_init!r}; use 'target' or 'random'")
    generator = torch.Generator().manual_seed(seed)
    embed = draft.get_input_embeddings().weight  # tied: the head shares it
    if embed_init == "target":
        rows = subset.ids if subset is not None else None
        weight = project_embeddings(target.get_input_embeddings().weight, config.hidden_size, rows,
                                    config.initializer_range, generator)
        embed.data[: weight.shape[0]] = weight
    if subset is not None and subset.factored:
        basis_rows, factors = factor_outside_rows(target.get_input_embeddings().weight, config.hidden_size, subset,
                                                  config.initializer_range, generator)
        if embed_init == "random":  # the random rows the model was built with; U = 0: a spread draft at step 0
            factors = torch.zeros_like(factors)
        else:
            embed.data[subset.size + 1:] = basis_rows
        attach_outside_factors(draft, factors)
    return draft, shape


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_pretrained_draft(ref: str, lora_rank: int, seed: int):
    """A pretrained draft (same tokenizer as the target); LoRA adapters when lora_rank > 0."""
    from common.models import load_model

    torch.manual_seed(seed)
    draft = load_model(ref)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        draft = get_peft_model(draft, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS))
    return draft
