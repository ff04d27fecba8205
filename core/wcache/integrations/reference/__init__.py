"""wcache's reference engine as the registry runs it: `verify --greedy --engine reference` (`greedy`)."""
