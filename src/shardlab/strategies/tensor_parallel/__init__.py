"""Tensor and sequence parallelism: hand-written (Megatron-style) and PyTorch DTensor comparators."""
