"""The engines that attach to daemons: vLLM (a load format), Hugging Face transformers, and the registry of
every engine `wcache verify --greedy` runs (`registry`, wcache's reference engine among them)."""
