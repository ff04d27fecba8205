"""vLLM: the load format `wcache` and its plugin (every vLLM import behind one version check, `api` and
`version`), its plan and formats, the in-place switch, the child of `verify --engine vllm` (`runner`,
`greedy`), and servers started warm (`warm`, `warm_zygote`, `warm_context`)."""
