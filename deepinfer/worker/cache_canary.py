"""The saved cache directory's start-up canary: the identity's rows, checked by their bits.

The cache identity (`prefix_store.cache_identity`) hashes every choice known to change a row's
bits (`contracts/numerics.py`). A choice it misses (a new knob, a library whose kernels changed,
a CPU that rounds differently) would let rows computed one way be served to an engine computing
another. So with a cache directory the runner computes a few fixed rows at start-up and compares
their bits with the record kept beside the identity's files:

    tokens 3..10 at positions 0..7, one prefill of that fixed shape (a CPU row's bits may depend on
    how many rows share its matmul), into scratch units: the first blocks of each paged group and
    state slot 0, zeroed first, their bytes and per-request state put back afterwards
      -> blake2b of those units' bytes (the K/V rows of every layer) and state

    <dir>/<root16>/canary         the digest (32 hex digits and a newline); the first engine writes it

    no record        write it (by link: the first writer wins), keep the identity
    same digest      keep the identity
    another digest   one warning; identity = sha256(identity, digest): a root of its own, whose
                     record this engine writes, so engines that compute alike share it again

With several tensor-parallel ranks every rank runs the same forward (its collectives included)
and then one all_reduce of the mismatch flags, whatever its own outcome or I/O errors: all ranks
move to new roots together, and none waits for another.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid

import torch

from deepinfer.contracts.kv_files import CANARY_RECORD, canary_file, root_dir
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.distributed.parallel_state import all_reduce, tp_size
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.worker import kv_dir_io
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.kv_disk import tensors_checksum

logger = logging.getLogger("deepinfer.kv_disk")

CANARY_TOKENS = tuple(range(3, 11))  # 8 tokens: every vocabulary has them
_RECORD_BYTES = 33  # 32 hex digits and a newline


def checked_identity(caches, identity: str, cache_config) -> str:
    """`identity`, or a new one when the canary's rows differ from the directory's record of it
    (one warning). Without a cache directory: `identity`, and nothing is run. `caches`: the cache
    runtime (`worker/cache_runtime.py`), its allocation bound to the model."""
    if not cache_config.kv_cache_dir or not cache_config.enable_prefix_caching:
        return identity
    directory = cache_config.kv_cache_dir
    digest = canary_digest(caches)
    recorded = _check_record(directory, identity, digest)
    if not _on_any_rank(recorded is not None, caches.device):
        return identity
    new = hashlib.sha256(f"{identity}:canary:{digest}".encode()).hexdigest()
    if recorded is not None:
        logger.warning("kv cache directory %s: the canary rows of identity %s differ from its record (%s, "
                       "computed %s): a setting that changes K/V bits is missing from the identity; "
                       "saving under root %s instead", directory, identity[:16], recorded, digest, new[:16])
    _check_record(directory, new, digest)
    return new


@torch.inference_mode()
def canary_digest(caches) -> str:
    """blake2b of the K/V rows (all layers) and per-request state a prefill of CANARY_TOKENS
    writes into scratch units of the cache runtime `caches`; those units are left as they were."""
    tokens = list(CANARY_TOKENS)
    block_ids, units = _scratch_units(caches, len(tokens))
    saved = {name: t.clone() for name, t in units.items()}
    state = caches.model.read_state(0)
    ring = tuple(0 for g in caches.groups if g.is_ring)
    try:
        for t in units.values():
            t.zero_()
        plan = StepPlan([ScheduledRequest("canary", tokens, 0, block_ids, ring)])
        inputs = build_step_inputs(plan, caches.addressing, caches.device)
        with forward_context(inputs.attn_metadata):
            caches.model(inputs.input_ids, inputs.positions)  # [T, hidden], dropped
        rows = {name: t.to("cpu") for name, t in units.items()}
        rows.update({f"state.{name}": t.to("cpu") for name, t in caches.model.read_state(0).items()})
        return tensors_checksum(rows)
    finally:
        for name, t in units.items():
            t.copy_(saved[name])
        caches.model.write_state(0, state)


def _scratch_units(caches, num_tokens: int) -> tuple[tuple[list[int], ...], dict[str, torch.Tensor]]:
    """Block tables (paged groups, in order) and the units the canary writes: the first blocks
    of each paged group and state slot 0 of each ring group (views into the cache)."""
    block_ids, units = [], {}
    for gi, g in enumerate(caches.groups):
        allocation = caches.cache.allocations[gi]
        if g.is_ring:
            units[f"ring.{g.name}"] = allocation[0]
            continue
        rows = -(-num_tokens // g.compress_ratio)
        ids = list(range(max(1, -(-rows // g.rows_per_unit))))
        block_ids.append(ids)
        units.update({f"page.{g.name}.{b}": allocation[b] for b in ids})
    return tuple(block_ids), units


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any tensor-parallel rank (every rank must call this)."""
    if tp_size() == 1:
        return flag
    flags = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    all_reduce(flags)  # [1]: how many ranks saw it
    return bool(flags.item())


def _check_record(directory: str, identity: str, digest: str) -> str | None:
    """The recorded digest when it differs from `digest`; None when it agrees or there was
    none (then this one is written). Never raises: the directory's store reports I/O trouble."""
    try:
        os.makedirs(directory, exist_ok=True)
        with kv_dir_io.folder(directory, [os.path.basename(root_dir(directory, identity))], create=True) as parent:
            for _ in range(2):
                recorded = _read_record(parent, canary_file(directory, identity))
                if recorded is not None:
                    return None if recorded == digest else recorded
                if _write_record(parent, digest):
                    return None
    except OSError as e:
        logger.info("kv cache directory %s: canary record not kept (%s)", directory, e)
    return None


def _read_record(parent: int, path: str) -> str | None:
    """The digest recorded in folder fd `parent`, or None when missing; an unusable record is
    removed (one warning) and reads as missing."""
    def check(size: int, head: bytes) -> str | None:
        return None if size == _RECORD_BYTES else f"{size} bytes, a record has {_RECORD_BYTES}"

    try:
        data, inode = kv_dir_io.read_regular(parent, CANARY_RECORD, path, check)
        text = data.decode("ascii", "replace").strip()
        if len(text) == _RECORD_BYTES - 1 and all(c in "0123456789abcdef" for c in text):
            return text
        reason = f"{text[:40]!r} is not a digest"
    except FileNotFoundError:
        return None
    except kv_dir_io.Hostile as e:
        logger.warning("kv cache entry %s", e)
        return None
    except kv_dir_io.BadSize as e:
        inode, reason = e.ino, str(e)
    logger.warning("kv cache canary record %s is damaged (%s); replaced", path, reason)
    kv_dir_io.remove(parent, CANARY_RECORD, inode)
    return None


def _write_record(parent: int, digest: str) -> bool:
    """Create the record unless one appeared meanwhile (False then)."""
    tmp = f".{CANARY_RECORD}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        kv_dir_io.write_new(parent, tmp, f"{digest}\n".encode())
        os.link(tmp, CANARY_RECORD, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        kv_dir_io.remove(parent, tmp)
