"""Training-side stages: target data generation (`distill.generate`), draft distillation
(`distill.train`) and the draft's export (`distill.export`).

distill/ may import decode/; decode/ never imports distill/.
"""
