"""The engines that attach to daemons, one sub-package each: vLLM (a load format), Hugging Face transformers,
wcache's reference engine; and the registry of every engine (`registry`)."""
