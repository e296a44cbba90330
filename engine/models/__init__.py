"""Model definitions. One module serves the Llama family (Llama, Mistral, Qwen2, Qwen3)."""
