"""Training-side stages: target data generation (`distill.generate`) and draft distillation.

distill/ may import decode/; decode/ never imports distill/.
"""
