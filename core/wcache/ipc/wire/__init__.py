"""The daemon wire: versioned msgpack frames over AF_UNIX (`framing`), the tagged requests and replies in
them (`messages`) and the client that sends them (`client`), the names of a daemon's counters in its `stats`
reply (`counters`), and the JSON lines a child writes its parent (`status_pipe`)."""
