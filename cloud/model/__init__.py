"""Model loading (GGUF, Hugging Face directories), tokenizer, chat template and the Llama forward."""
