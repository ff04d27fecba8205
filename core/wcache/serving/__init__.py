"""The reference engine as a service: its OpenAI-style HTTP API (`server`), every TP rank serving behind it
(`ranks`), switching its weights in place (`switch`), following the newest version
built from them (`follow`), and a client of that API (`client`).

Apart from `wcache.engine` (the engine itself), which never imports it."""
