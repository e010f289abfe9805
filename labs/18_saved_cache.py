"""Lab 18: the payload formula beside the bytes a real prefix takes in a saved cache directory.

Two models each save one prompt's prefix to a temporary `kv_cache_dir` and start again:
the default model (SmolLM2-135M, `LLM()`), whose rows follow 2 · L · H_kv · d · T · b, and
DeepSeek-V4 (configs/deepseek_v4_flash_mini with small widths, seeded dummy weights, MXFP8
rows), whose rows follow layers × rows(T) × row bytes per cache group. The reduced V4 config
keeps every width the cache depends on (head_dim 512, index_head_dim 128, W = 128, m = 4 and
128, the layer types), so its rows, pages, rings and compressor state are those of the mini
config; only the weights shrink, so it builds in seconds instead of a minute and 14 GB.

For each model the lab prints the formula's payload for the prefix T (T: the tokens the first
request after the restart finds cached), then every file the first engine left in the
directory, as read from the files themselves (safetensors: an 8-byte header length, a JSON
header with the unit's metadata and checksum, then the tensors), then what the restart read.
Every size comes from the package's sizing record (`worker/cache_sizing.py`) and row formats
(`ops/cache_common.py`) or from the files; nothing here restates a formula.

    python labs/18_saved_cache.py
    python labs/18_saved_cache.py --device cuda   # the default model's rows in its CUDA dtype
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from labio import emit
from safetensors.torch import load as load_tensors

from deepinfer import LLM, SamplingParams
from deepinfer.contracts import kv_files
from deepinfer.model_executor.layers.ops.cache_common import kv_payload_bytes, row_payload_bytes
from deepinfer.worker.kv_disk import tensors_checksum

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "results" / "18_saved_cache.txt"
V4_MINI = ROOT / "configs" / "deepseek_v4_flash_mini" / "config.json"
# configs/deepseek_v4_flash_mini with small widths; every cache-shaping field is kept
V4_SMALL_WIDTHS = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                       index_n_heads=2, n_routed_experts=8, moe_intermediate_size=32, vocab_size=512,
                       max_position_embeddings=4096)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
LLAMA_PROMPT_TOKENS = 70  # four blocks of 16 and a tail
V4_PROMPT_TOKENS = 300  # four 64-token units and a tail
LENGTH_BYTES = 8  # a safetensors file starts with its header's length, a little-endian u64


def prompt(num_tokens: int) -> list[int]:
    """Fixed token ids below 512 (inside both vocabularies), none of them special."""
    return [3 + (37 * i) % 500 for i in range(num_tokens)]


def v4_config() -> dict:
    """The V4 mini config with small widths."""
    return {**json.loads(V4_MINI.read_text()), **V4_SMALL_WIDTHS}


# ---- running: save, close, start again ----------------------------------------------------------

def save_and_restart(model: str | None, ids: list[int], directory: Path, **kwargs) -> dict:
    """A first engine saves `ids`' prefix and closes; the directory is read; a second engine in
    this process serves the same prompt. Returns the sizing, the files and the restart's numbers."""
    kwargs = dict(kv_cache_dir=str(directory), **kwargs)
    with LLM(model, **kwargs) as first:
        first.generate([ids], GREEDY, use_tqdm=False)
        runner = first.engine.runner
        model_type = first.engine.source.hf_config.model_type
        groups, codecs, sizing = runner.groups, runner.caches.codecs, runner.caches.sizing
    saved = scan(directory)
    with LLM(model, **kwargs) as second:
        out = second.generate([ids], GREEDY, use_tqdm=False)[0]
        metrics = second.get_metrics()
    return dict(model_type=model_type, groups=groups, codecs=codecs, sizing=sizing, saved=saved,
                num_prompt=len(ids), cached=out.num_cached_tokens, files_read=metrics["kv_cache_dir_files_read"],
                bytes_read=metrics["kv_cache_dir_bytes_read"])


def scan(directory: Path) -> dict:
    """Everything under the directory: identity folders, unit files (read), canary records, others."""
    found = dict(folders=0, units=[], canaries=[], others=[])
    for path in sorted(directory.rglob("*")):
        if path.is_dir():
            found["folders"] += path.parent == directory
        elif path.name.endswith(kv_files.KV_FILE_SUFFIX):
            found["units"].append(read_unit(path))
        elif path.name == kv_files.CANARY_RECORD:
            found["canaries"].append(path.stat().st_size)
        else:
            found["others"].append((path.name, path.stat().st_size))
    return found


def read_unit(path: Path) -> dict:
    """One unit file's parts: header length field, header, tensors by name, and its checksum."""
    data = path.read_bytes()
    header_bytes = int.from_bytes(data[:LENGTH_BYTES], "little")
    header = json.loads(data[LENGTH_BYTES:LENGTH_BYTES + header_bytes])
    meta = header.pop("__metadata__")
    tensors = {name: (tuple(info["shape"]), info["data_offsets"][1] - info["data_offsets"][0])
               for name, info in header.items()}  # name -> (shape, bytes)
    checksum = meta["checksum"]
    return dict(kind=meta["kind"], size=len(data), header=header_bytes, tensors=tensors,
                checksum_chars=len(checksum), checksum_ok=tensors_checksum(load_tensors(data)) == checksum)


# ---- printing -------------------------------------------------------------------------------

def llama_formula_block(name: str, run: dict) -> tuple[list[str], int]:
    """2 · L · H_kv · d · T · b for the one plain paged group of a Llama-family model."""
    [group], [spec], [codec] = run["sizing"].groups, run["groups"], run["codecs"]
    if group.is_ring or group.compress_ratio != 1 or spec.row.shared_kv:
        raise ValueError(f"{name}: 2 · L · H_kv · d · T · b needs one plain paged K|V group, got {spec}")
    layers, heads, dim, tokens = group.num_layers, spec.row.num_kv_heads, spec.row.head_dim, run["cached"]
    b = codec.row_dtype.itemsize
    total = kv_payload_bytes(layers, heads, dim, tokens, b)
    return [f"{name} ({run['model_type']}): {run['num_prompt']}-token prompt, prefix T = {tokens} tokens",
            f"group {group.name}: {layers} layers, {heads} KV heads, head_dim {dim}, "
            f"{codec.format.note} of {codec.row_bytes:,} B (b = {b})",
            f"formula 2 · L · H_kv · d · T · b = 2 · {layers} · {heads} · {dim} · {tokens} · {b} = {total:,} B"], total


def latent_formula_block(name: str, run: dict) -> tuple[list[str], int]:
    """layers × rows(T) × row bytes per cache group (rows(T): min(T, W) or T / m)."""
    tokens = run["cached"]
    lines = [f"{name} ({run['model_type']}): {run['num_prompt']}-token prompt, prefix T = {tokens} tokens"]
    total = 0
    for group, codec in zip(run["sizing"].groups, run["codecs"], strict=True):
        rows = group.visible_rows(tokens)
        payload = row_payload_bytes(rows, codec.format, group.num_layers)
        total += payload
        shape = (f"ring, W = {group.window}, S = {group.rows_per_unit}" if group.is_ring
                 else f"m = {group.compress_ratio}")
        lines.append(f"group {group.name} ({shape}): {plural(group.num_layers, 'layer')} × {rows} rows × "
                     f"{codec.row_bytes} B ({codec.format.note}) = {payload:,} B")
    lines.append(f"formula (latent rows, all groups): {total:,} B")
    lines.append(f"compressor state per request (sizing record, not rows): {run['sizing'].state_bytes:,} B")
    return lines, total


def disk_block(saved: dict, formula: int) -> list[str]:
    """The directory as found: per unit kind, its files' bytes split into header and tensors; then
    the rows and pages on disk beside the formula's payload."""
    units = saved["units"]
    others = "".join(f", file {name} ({size} B)" for name, size in saved["others"])
    lines = [f"saved cache: {plural(saved['folders'], 'identity folder')}, {plural(len(units), 'unit file')}, "
             f"{plural(len(saved['canaries']), 'canary record')} of {', '.join(map(str, saved['canaries']))} B"
             + others]
    for kind in sorted({u["kind"] for u in units}):
        lines.extend(unit_lines(kind, [u for u in units if u["kind"] == kind]))
    ok = sum(u["checksum_ok"] for u in units)
    lines.append(f"checksums: {ok} of {len(units)} match their tensors "
                 f"(blake2b-128, {units[0]['checksum_chars']} hex digits in each header)")
    rows = sum(size for u in units for name, (_, size) in u["tensors"].items() if not is_state(name))
    state = sum(size for u in units for name, (_, size) in u["tensors"].items() if is_state(name))
    headers = sum(LENGTH_BYTES + u["header"] for u in units)
    lines.append(f"unit files in all: {sum(u['size'] for u in units):,} B = {rows:,} B rows and pages"
                 + (f" + {state:,} B state" if state else "") + f" + {headers:,} B headers")
    extra = f"= formula + {rows - formula:,} B (whole ring slots and pages)" if rows != formula else "= formula"
    lines.append(f"rows and pages on disk {rows:,} B {extra}")
    return lines


def unit_lines(kind: str, units: list[dict]) -> list[str]:
    """One line per distinct file layout of a kind: count × size = length + header + tensors."""
    layouts = defaultdict(int)
    for u in units:
        layouts[(u["size"], u["header"], tuple(sorted(u["tensors"].items())))] += 1
    lines = []
    for (size, header, tensors), count in sorted(layouts.items()):
        lines.append(f"{kind}: {plural(count, 'file')} × {size:,} B = {LENGTH_BYTES} B length + {header:,} B header"
                     f" + {size - LENGTH_BYTES - header:,} B tensors")
        lines.extend(f"  {part}" for part in tensor_parts(dict(tensors)))
    return lines


def tensor_parts(tensors: dict[str, tuple]) -> list[str]:
    """Tensor bytes by part: each ring and page tensor by name; the state's arrays and its
    scalar token counts together, with the number of compressors they belong to."""
    parts = [f"{name}: {size:,} B" for name, (_, size) in tensors.items() if not is_state(name)]
    state = {name: info for name, info in tensors.items() if is_state(name)}
    if state:
        owners = {name.split(".")[1] for name in state}
        arrays = [size for shape, size in state.values() if shape]
        scalars = [size for shape, size in state.values() if not shape]
        parts.append(f"state of {len(owners)} compressors: {sum(arrays):,} B in {len(arrays)} arrays + "
                     f"{sum(scalars):,} B in {len(scalars)} token counts")
    return parts


def is_state(name: str) -> bool:
    return name.startswith("state.")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def restart_block(run: dict) -> list[str]:
    return [f"after the restart: first request's num_cached_tokens = {run['cached']} of {run['num_prompt']}, "
            f"{run['files_read']} unit files read ({run['bytes_read']:,} B)"]


# ---- the lab ----------------------------------------------------------------------------------

def run_models(device: str = "cpu") -> list[list[str]]:
    """Both models: formula, directory and restart blocks."""
    blocks = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        llama = save_and_restart(None, prompt(LLAMA_PROMPT_TOKENS), tmp / "kv-default", max_model_len=256,
                                 device=device)
        formula, total = llama_formula_block("default model", llama)
        blocks += [formula, disk_block(llama["saved"], total), restart_block(llama)]
        config_dir = tmp / "v4-mini-small"
        config_dir.mkdir()
        (config_dir / "config.json").write_text(json.dumps(v4_config(), indent=2))
        v4 = save_and_restart(str(config_dir), prompt(V4_PROMPT_TOKENS), tmp / "kv-v4", max_model_len=512,
                              load_format="dummy", kv_cache_dtype="fp8", device=device)
        formula, total = latent_formula_block("V4 mini, small widths", v4)
        blocks += [formula, disk_block(v4["saved"], total), restart_block(v4)]
    return blocks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu",
                   help="where both engines run (the golden output is the CPU's: fp32 rows for the default model)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save the output")
    a = p.parse_args(argv)
    try:
        blocks = run_models(a.device)
    except ValueError as e:
        p.error(str(e))
    emit(blocks, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
