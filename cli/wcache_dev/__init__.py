"""Not the product: checkpoint writers and sample data for the demo, tests and benchmarks, vLLM's old
fingerprint for comparison, and the man-page generator."""
