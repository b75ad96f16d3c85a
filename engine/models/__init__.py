"""The model side of the engine: checkpoint configs, the safetensors loader, the tokenizer, and the
decoder (attention, latent attention, MoE routers and stacked experts, norms and RoPE)."""
