"""Engines other than wcache's own that attach to daemons: vLLM (a load format) and Hugging Face transformers."""
