"""DeepSeek-V4 KV compressors of the attention layers: HCA (one series) and CSA (two overlapping
series), with the CSA compressor's lightning indexer.

The streaming pooling they run (windows, slots, state across chunks) is `pooling`'s
`WindowCompressor`; its names are importable from here too.
"""

from __future__ import annotations

from deepinfer.model_executor.models.deepseek_v4.indexer import Indexer
from deepinfer.model_executor.models.deepseek_v4.pooling import (
    CSA,
    HCA,
    CompressorState,
    WindowCompressor,
    apply_interleaved_rope,
    compress_rope_inv_freq,
)

__all__ = ["CSA", "HCA", "CSACompressor", "CompressorState", "HCACompressor", "WindowCompressor",
           "apply_interleaved_rope", "compress_rope_inv_freq"]


class HCACompressor(WindowCompressor):
    """Heavily compressed attention: one series, ratio ``compress_rates[HCA]``, head_dim wide."""

    def __init__(self, config):
        super().__init__(config, config.head_dim, config.compress_rates[HCA], overlap=False)


class CSACompressor(WindowCompressor):
    """Compressed sparse attention: two overlapping series, ratio ``compress_rates[CSA]``.

    Owns its lightning indexer as ``self.indexer`` (as the HF checkpoint names it) unless
    ``with_indexer=False``.
    """

    def __init__(self, config, with_indexer: bool = True):
        super().__init__(config, config.head_dim, config.compress_rates[CSA], overlap=True)
        if with_indexer:
            self.indexer = Indexer(config)
