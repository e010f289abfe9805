"""DeepSeek-V4: hyper-connections, MoE, compressed attention pieces and quantized-weight loading."""
