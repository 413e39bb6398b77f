"""The layers every family stacks: attention metadata and its GQA/MLA forms, MLP, MoE,
RMSNorm, RoPE, the linear layer and building modules on meta tensors."""
