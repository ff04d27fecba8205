"""Everything that crosses a process boundary: the run dir and what ranks publish in it, the wire protocol and
its client, the status pipe, the shared-memory arena and the HTTP server base."""
