"""Test doubles for parts that cannot run here (TensorRT and CUDA need an NVIDIA GPU)."""
