"""Attention, GEMM, LoRA and rotary kernels: torch for CPUs (and as the reference), C++ for CPUs
(csrc/, built once per machine), Triton for GPUs."""
