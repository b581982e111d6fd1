"""Training-side stages: target data generation (`distill.generate`), draft distillation
(`distill.train`) and the draft's export (`distill.export`).

distill/ may import decode/ and common/; decode/ never imports distill/.
"""
