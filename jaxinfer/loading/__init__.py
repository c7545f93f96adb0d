"""Loading models: checkpoints (Orbax), HF safetensors and GGUF sources, random presets,
tokenizers, the default model, memory planning and weight counting."""
