"""KV-cache row formats, payload formulas and ring sizes (book §3.3, §3.4.3). Pure Python.

Three quantities that the book keeps apart:

- visible rows:    what attention may read, `min(L, W)` for a window of W;
- allocated rows:  what the engine keeps, e.g. a ring of S = W + allowance rows (134 vs 128);
- bytes per row:   the physical format, e.g. `V41_FORMAT` = 512 e4m3 + 16 UE8M0 = 528 B.

Payload formulas count only rows of keys/values: no allocation padding, no other state, no
temporary buffers. Callers that report memory show allocated rows beside visible rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.environ import Environ, get_environ

# Bits per stored element of each quantized dtype, and bytes per stored scale factor.
_QUANTIZED_BITS = {"e4m3": 8, "e5m2": 8, "e2m1": 4, "int8": 8}
_SCALE_FACTOR_BYTES = {"ue8m0": 1, "fp32": 4}
# Bytes per unquantized element. The book's formats keep them as bf16; a CPU engine computing in
# fp32 keeps fp32 rows, counted through the same field.
_UNQUANTIZED_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MXFP8_ELEMENTS_PER_SF = 32  # one UE8M0 scale byte per 32 e4m3 values
Q8_ELEMENTS_PER_SF = 32  # one fp32 scale per 32 int8 values (ops/q8.py)
BF16_BYTES = 2


def check_int(name: str, value, minimum: int = 0) -> int:
    """Return `value` if it is an int >= minimum; else ValueError naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class KVCacheFormat:
    """The physical layout of one cache row: quantized values + their scales, then bf16 values.

    One row holds `num_elements` model values; `bytes_per_row` counts everything stored for
    them, scales included. Quantized values share one scale factor per `elements_per_sf`.
    """

    quantized_dtype: str | None = None  # "e4m3", "e5m2", "e2m1", "int8"; None when nothing is quantized
    quantized_elements: int = 0  # values stored in quantized_dtype
    elements_per_sf: int = 0  # quantized values per scale factor
    bf16_elements: int = 0  # values stored as bf16 (2 bytes each)
    do_cast: bool = False  # rows are cast to the quantized dtype on store
    sf_format: str | None = None  # scale-factor encoding, "ue8m0" (one byte, power of two), "fp32"
    note: str = ""
    token_interleaved: bool = False  # a token's values and scales lie together in its row
    unquantized_dtype: str = "bf16"  # storage of the bf16_elements: "bf16" (the book), "fp16", "fp32"

    def __post_init__(self):
        check_int("quantized_elements", self.quantized_elements)
        check_int("bf16_elements", self.bf16_elements)
        check_int("elements_per_sf", self.elements_per_sf)
        if self.unquantized_dtype not in _UNQUANTIZED_BYTES:
            raise ValueError(f"unquantized_dtype must be one of {sorted(_UNQUANTIZED_BYTES)}, "
                             f"got {self.unquantized_dtype!r}")
        if self.num_elements == 0:
            raise ValueError("a KVCacheFormat must hold at least one element, got 0")
        if self.quantized_elements:
            self._check_quantized()

    def _check_quantized(self) -> None:
        if self.quantized_dtype not in _QUANTIZED_BITS:
            raise ValueError(f"quantized_dtype must be one of {sorted(_QUANTIZED_BITS)}, "
                             f"got {self.quantized_dtype!r}")
        if self.sf_format not in _SCALE_FACTOR_BYTES:
            raise ValueError(f"sf_format must be one of {sorted(_SCALE_FACTOR_BYTES)}, "
                             f"got {self.sf_format!r}")
        if self.elements_per_sf < 1 or self.quantized_elements % self.elements_per_sf:
            raise ValueError(f"quantized_elements={self.quantized_elements} must be a multiple of "
                             f"elements_per_sf={self.elements_per_sf}")
        if self.quantized_elements * _QUANTIZED_BITS[self.quantized_dtype] % 8:
            raise ValueError(f"quantized_elements={self.quantized_elements} of {self.quantized_dtype} "
                             "do not fill whole bytes")

    @property
    def num_elements(self) -> int:
        """Model values per row (quantized + bf16)."""
        return self.quantized_elements + self.bf16_elements

    @property
    def num_scale_factors(self) -> int:
        return self.quantized_elements // self.elements_per_sf if self.quantized_elements else 0

    @property
    def data_bytes(self) -> int:
        """Bytes of the values themselves (quantized + bf16), scales excluded."""
        quantized_bits = self.quantized_elements * _QUANTIZED_BITS.get(self.quantized_dtype, 0)
        return quantized_bits // 8 + _UNQUANTIZED_BYTES[self.unquantized_dtype] * self.bf16_elements

    @property
    def scale_bytes(self) -> int:
        return self.num_scale_factors * _SCALE_FACTOR_BYTES.get(self.sf_format, 0)

    @property
    def bytes_per_row(self) -> int:
        """Everything one row stores: data bytes + scale bytes."""
        return self.data_bytes + self.scale_bytes


# The shared K/V row of a DeepSeek-V4 SWA layer (book listing 3.7): 512 + 512/32 = 528 bytes.
V41_FORMAT = KVCacheFormat(
    quantized_dtype="e4m3",
    quantized_elements=512,
    elements_per_sf=MXFP8_ELEMENTS_PER_SF,
    bf16_elements=0,
    do_cast=True,
    sf_format="ue8m0",
    note="V41, main/swa kv.",
    token_interleaved=True,
)


def separate_kv_row_elements(num_kv_heads: int, head_dim: int) -> int:
    """Elements of one Llama-family row: K and V of every KV head of one layer, one token."""
    return 2 * check_int("num_kv_heads", num_kv_heads, 1) * check_int("head_dim", head_dim, 1)


def mxfp8_format(row_elements: int, note: str = "MXFP8 row") -> KVCacheFormat:
    """An MXFP8 row of `row_elements` e4m3 values, one UE8M0 scale byte per 32 values."""
    check_int("row_elements", row_elements, 1)
    if row_elements % MXFP8_ELEMENTS_PER_SF:
        raise ValueError(f"MXFP8 row_elements must be a multiple of {MXFP8_ELEMENTS_PER_SF} "
                         f"(one scale per {MXFP8_ELEMENTS_PER_SF} values), got {row_elements}")
    return KVCacheFormat(quantized_dtype="e4m3", quantized_elements=row_elements,
                         elements_per_sf=MXFP8_ELEMENTS_PER_SF, do_cast=True, sf_format="ue8m0",
                         note=note, token_interleaved=True)


def q8_format(row_elements: int, note: str = "q8 row") -> KVCacheFormat:
    """A q8 row (ops/q8.py) of `row_elements` int8 values, one fp32 scale per 32 values."""
    check_int("row_elements", row_elements, 1)
    if row_elements % Q8_ELEMENTS_PER_SF:
        raise ValueError(f"int8 row_elements must be a multiple of {Q8_ELEMENTS_PER_SF} "
                         f"(one scale per {Q8_ELEMENTS_PER_SF} values), got {row_elements}")
    return KVCacheFormat(quantized_dtype="int8", quantized_elements=row_elements, elements_per_sf=Q8_ELEMENTS_PER_SF,
                         do_cast=True, sf_format="fp32", note=note, token_interleaved=True)


def bf16_format(row_elements: int, note: str = "bf16 row") -> KVCacheFormat:
    """A row of `row_elements` bf16 values (2 bytes each), no scales."""
    return KVCacheFormat(bf16_elements=check_int("row_elements", row_elements, 1), note=note)


def unquantized_format(row_elements: int, dtype: str, note: str = "") -> KVCacheFormat:
    """A row of `row_elements` values stored as `dtype` ("bf16", "fp16" or "fp32"), no scales."""
    return KVCacheFormat(bf16_elements=check_int("row_elements", row_elements, 1), note=note or f"{dtype} row",
                         unquantized_dtype=dtype)


def visible_rows(num_tokens: int, window_size: int | None = None) -> int:
    """Rows one query may read at context length L: L, or min(L, W) under a window W."""
    check_int("num_tokens", num_tokens)
    if window_size is None:
        return num_tokens
    return min(num_tokens, check_int("window_size", window_size, 1))


def kv_payload_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                     bytes_per_element: int) -> int:
    """Separate K and V, full attention: 2 · n_layers · h_kv · d · L · b bytes.

    Query heads do not occur: heads that share a KV head read the same stored rows.
    """
    check_int("num_layers", num_layers, 1)
    check_int("bytes_per_element", bytes_per_element, 1)
    check_int("num_tokens", num_tokens)
    return num_layers * separate_kv_row_elements(num_kv_heads, head_dim) * num_tokens * bytes_per_element


def window_kv_payload_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                            window_size: int, bytes_per_element: int) -> int:
    """Separate K and V, every layer windowed: 2 · n_layers · h_kv · d · min(L, W) · b bytes."""
    rows = visible_rows(num_tokens, window_size)
    return kv_payload_bytes(num_layers, num_kv_heads, head_dim, rows, bytes_per_element)


def row_payload_bytes(num_rows: int, fmt: KVCacheFormat, num_layers: int = 1) -> int:
    """Rows stored in `fmt`: num_rows · fmt.bytes_per_row per layer, times num_layers."""
    check_int("num_rows", num_rows)
    return check_int("num_layers", num_layers, 1) * num_rows * fmt.bytes_per_row


def get_inference_swa_block_size(window_size: int, env: Environ | None = None, num_drafts: int | None = None) -> int:
    """Ring rows per state for inference: W + max(MAX_BACKTRACKING_TOKENS, USE_NEXTN_DECODE + 1).

    With the defaults, 128 + max(0, 5 + 1) = 134: the window plus a backtracking allowance for
    draft verification. The allowance is an engine choice, not part of the attention window.
    `num_drafts`: the engine's draft allowance k (`SpeculativeConfig.num_speculative_tokens`) in
    place of USE_NEXTN_DECODE; None: the knob, as the book reads it.
    """
    env = get_environ() if env is None else env
    k = env.use_nextn_decode if num_drafts is None else num_drafts
    allowance = max(env.max_backtracking_tokens, k + 1)
    return check_int("window_size", window_size, 1) + allowance


def get_kvstore_swa_block_size(window_size: int, env: Environ | None = None, num_drafts: int | None = None) -> int:
    """Ring rows per state in the kv store: the inference ring, plus prefill extra state if on.

    With DEEPINFER_PREFILL_STORE_EXTRA_STATE on, add DEEPINFER_PREFILL_STORE_EXTRA_SIZE and,
    inside that branch only, DEEPINFER_YOCO_PREFILL_KEEP_TOKENS when YOCO truncation is on.
    """
    env = get_environ() if env is None else env
    size = get_inference_swa_block_size(window_size, env, num_drafts)
    if env.prefill_store_extra_state:
        size += env.prefill_store_extra_size
        if env.yoco_prefill_truncation:
            size += env.yoco_prefill_keep_tokens
    return size
