"""Test helpers: tiny random-weight models (tiny_models) and a minimal forward harness
(forward_harness) that runs models over the real KV pools on CPU."""
