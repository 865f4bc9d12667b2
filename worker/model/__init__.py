"""The model: our Llama-family forward pass, its runner over paged KV, LoRA slots, checkpoints."""
