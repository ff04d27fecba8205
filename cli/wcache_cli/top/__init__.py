"""`wcache top`: the live dashboard (Textual, imported only by the command) and its headless views."""
