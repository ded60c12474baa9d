"""vllm-dsbd: Dynamic-Width Speculative Beam Decoding for vLLM."""
