"""The wcache command line: Typer commands over the wcache library; presentation and parsing only."""
