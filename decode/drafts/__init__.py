"""The draft kinds, one package each, holding everything the kind is: how it is built for a parameter
budget, its model, its chain and tree proposers, and what the cost model times.

  standalone/  a small language model of its own (any HF causal LM; scratch, pretrained or LoRA)
  feature/     an EAGLE-3-style head reading the target's hidden states
"""
