"""DeepSeek-V2 / V2-Lite / V3 / R1: multi-head latent attention (MLA) over one shared latent row per token."""
