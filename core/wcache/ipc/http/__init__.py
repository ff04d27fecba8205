"""wcache's HTTP: the one server stack and its hardened handler (`server`), and the one client of wcache's own
endpoints (`client`: `top`, `status`, the demo and the served engine's client)."""
