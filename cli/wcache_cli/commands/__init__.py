"""One module per wcache command."""
