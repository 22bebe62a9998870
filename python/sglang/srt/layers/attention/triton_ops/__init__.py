"""Triton kernels for the triton attention backend (decode and ragged extend, page size 1)."""
