"""The small learned modules at checkpoints: routers, exit heads and draft heads (`router`), the fused
router-exit kernel and its PyTorch reference (`kernels`), draft vocabularies (`draftvocab`)."""
