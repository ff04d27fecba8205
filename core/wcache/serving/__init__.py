"""The reference engine as a service: its OpenAI-style HTTP API (`server`), every TP rank serving behind it
(`ranks`), switching its weights in place (`switch`), and a client of that API (`client`).

Apart from `wcache.engine` (the engine itself), which never imports it."""
