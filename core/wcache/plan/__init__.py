"""The processing plan: what turns checkpoint tensors into one rank's engine tensors (spec, processing, the fused
layout, load-time quantization, the model family)."""
