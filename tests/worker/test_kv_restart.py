"""The saved KV cache across start-ups (`kv_cache_dir`).

A first engine saves its cached blocks and snapshots, closes, and a *new process* with the same
directory gets hits on its first request (read from disk) and the tokens of caching off: for a
paged model (tiny llama), a ring model (tiny gemma3: local + global layers) and tiny
DeepSeek-V4 (ring + compressed groups + compressor state in the snapshots). Damaged, truncated
and foreign files are logged misses, recomputed to the right tokens; the directory stays within
its budget; two processes can share it at once; bad settings are refused at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.kv_files import unit_file
from deepinfer.engine.prefix_cache import chain_hash, chain_root

pytestmark = [pytest.mark.parity]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "deepseek_v4"))

MAX_TOKENS = 4
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
KW = dict(max_num_batched_tokens=128, max_model_len=256, prefix_snapshot_interval=32)  # chunking: test_prefix_parity
LLAMA_BLOCK = 16

CHILD = r'''
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
from deepinfer import LLM, SamplingParams

args = json.loads(sys.argv[1])
llm = LLM(args["model"], **args["kw"])
params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True)
outs = []
for prompt in args["prompts"]:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    outs.append({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens})
llm.engine.kv_manager.check_no_leaks()
metrics = {k: v for k, v in llm.get_metrics().items() if isinstance(v, (int, float))}
llm.close()
print("RESULT " + json.dumps({"outs": outs, "metrics": metrics}))
'''


def child_args(model: str, cache_dir: str, prompts, **kw) -> list[str]:
    return [sys.executable, "-c", CHILD, json.dumps({"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS,
                                                    "kw": {**KW, "kv_cache_dir": cache_dir, **kw}})]


def child_result(proc: subprocess.CompletedProcess | tuple) -> tuple[dict, str]:
    stdout, stderr, rc = (proc.stdout, proc.stderr, proc.returncode) if hasattr(proc, "stdout") else proc
    assert rc == 0, stderr[-4000:]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), stderr


def run_child(model: str, cache_dir: str, prompts, **kw) -> tuple[dict, str]:
    """A new Python process: LLM(model, kv_cache_dir=cache_dir), the prompts one at a time, close."""
    return child_result(subprocess.run(child_args(model, cache_dir, prompts, **kw), capture_output=True, text=True,
                                       timeout=300))


def generate(llm: LLM, prompts) -> list:
    outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]
    llm.engine.kv_manager.check_no_leaks()
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)


def saved_files(directory: str) -> list[str]:
    return sorted(os.path.join(root, f) for root, _, files in os.walk(directory) for f in files
                  if f.endswith(".safetensors"))


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    """A 90-token prefix (past two snapshot intervals) with two tails."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(90)]
    return [base + [rng.randrange(3, vocab) for _ in range(n)] for n in (7, 12)]


def unit_path(directory: str, identity: str, prompt: list[int], index: int, kind: str = "full") -> str:
    """The saved file of the prompt's unit `index` (0-based, LLAMA_BLOCK tokens each)."""
    key = chain_root(identity, None)
    for i in range(index + 1):
        key = chain_hash(key, prompt[i * LLAMA_BLOCK:(i + 1) * LLAMA_BLOCK])
    return unit_file(directory, identity, key.hex(), kind)


# ---- a new process reads what the first one saved -------------------------------------------------

def tiny_v4_dir(tmp_path_factory, name: str) -> str:
    """A tiny DeepSeek-V4 checkpoint (sliding, CSA, HCA, CSA layers) in a new temporary folder."""
    from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4

    path = str(tmp_path_factory.mktemp(name))
    make_tiny_v4(path, [SLIDING, CSA, HCA, CSA])
    return path


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    return tiny_v4_dir(tmp_path_factory, "v4-restart")


@pytest.mark.subprocess
@pytest.mark.parametrize("arch", ["llama", "gemma3", "v4"])
def test_new_process_hits_the_saved_cache(arch, tiny_checkpoint, v4_path, tmp_path):
    if arch == "v4":
        from v4_tiny import VOCAB

        path, vocab, kw = v4_path, VOCAB, dict(block_size=4, num_blocks=64)
    else:
        path, vocab, kw = tiny_checkpoint(arch), 49152, dict(num_blocks=32)
    prompts = prompts_for(vocab, seed=len(arch))
    ref = tokens(generate(LLM(path, enable_prefix_caching=False, **KW, **kw), prompts))
    cache_dir = str(tmp_path / "kv")
    with LLM(path, kv_cache_dir=cache_dir, **KW, **kw) as first:
        outs = generate(first, prompts)
        assert tokens(outs) == ref and outs[0].num_cached_tokens == 0
    assert saved_files(cache_dir)
    if arch != "llama":
        assert any(f.endswith(".snapshot.safetensors") for f in saved_files(cache_dir)), "ring models save snapshots"

    result, stderr = run_child(path, cache_dir, prompts, **kw)
    assert [o["tokens"] for o in result["outs"]] == ref
    cached = [o["cached"] for o in result["outs"]]
    assert cached[0] >= 64 and cached[1] >= 64, cached  # the first request of the new process hits
    metrics = result["metrics"]
    assert metrics["prefix_cache_disk_hits"] > 0 and metrics["kv_cache_dir_files_read"] > 0
    assert metrics["kv_cache_dir_load_failures"] == 0 and "WARNING" not in stderr, stderr


@pytest.mark.subprocess
def test_two_processes_share_one_directory_at_once(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    prompts = prompts_for(49152, seed=21)
    ref = tokens(generate(LLM(path, enable_prefix_caching=False, **KW), prompts))
    cache_dir = str(tmp_path / "kv")
    budget = 40 * 9000
    procs = [subprocess.Popen(child_args(path, cache_dir, order, kv_cache_dir_size=budget), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for order in (prompts, prompts[::-1])]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append(child_result((out, err, proc.returncode))[0])
    assert [o["tokens"] for o in results[0]["outs"]] == ref
    assert [o["tokens"] for o in results[1]["outs"]] == ref[::-1]
    assert 0 < dir_bytes(cache_dir) <= budget
    # what they left is whole: this process reads it
    with LLM(path, kv_cache_dir=cache_dir, **KW) as llm:
        outs = generate(llm, prompts)
        assert tokens(outs) == ref and outs[0].num_cached_tokens >= 64
        assert llm.get_metrics()["kv_cache_dir_load_failures"] == 0


# ---- damaged, truncated and foreign files --------------------------------------------------------------

def saved_llama_dir(tiny_checkpoint, tmp_path_factory, seed: int, name: str) -> dict:
    """A tiny llama's cache directory after one run, its identity and the caching-off tokens."""
    path = tiny_checkpoint("llama")
    prompts = prompts_for(49152, seed=seed)
    ref = tokens(generate(LLM(path, enable_prefix_caching=False, **KW), prompts))
    cache_dir = str(tmp_path_factory.mktemp(name))
    with LLM(path, kv_cache_dir=cache_dir, **KW) as llm:
        assert tokens(generate(llm, prompts)) == ref
        identity = llm.engine.runner.cache_identity
    return dict(path=path, dir=cache_dir, identity=identity, prompts=prompts, ref=ref)


@pytest.fixture(scope="module")
def llama_saved(tiny_checkpoint, tmp_path_factory):
    return saved_llama_dir(tiny_checkpoint, tmp_path_factory, seed=5, name="kv-llama")


@pytest.fixture(scope="module")
def qwen2_file(tiny_checkpoint, tmp_path_factory) -> str:
    """A saved block of another model (tiny qwen2: the same row shapes, another identity)."""
    cache_dir = str(tmp_path_factory.mktemp("kv-qwen2"))
    with LLM(tiny_checkpoint("qwen2"), kv_cache_dir=cache_dir, **KW) as llm:
        generate(llm, prompts_for(49152, seed=6)[:1])
    return saved_files(cache_dir)[0]


def _flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0x5A
    open(path, "wb").write(bytes(data))


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


DAMAGE = {"flipped": (_flip, "damaged"), "truncated": (_truncate, "damaged"), "foreign": (None, "foreign")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_bad_file_is_a_logged_miss_with_the_right_tokens(damage, llama_saved, qwen2_file, tmp_path, caplog):
    cache_dir = str(tmp_path / "kv")
    shutil.copytree(llama_saved["dir"], cache_dir)
    prompt = llama_saved["prompts"][0]
    victim = unit_path(cache_dir, llama_saved["identity"], prompt, 3)  # the 4th block of the shared prefix
    assert os.path.exists(victim)
    damage_fn, word = DAMAGE[damage]
    if damage_fn is None:
        shutil.copyfile(qwen2_file, victim)
    else:
        damage_fn(victim)
    caplog.set_level(logging.WARNING)
    with LLM(llama_saved["path"], kv_cache_dir=cache_dir, **KW) as llm:
        outs = generate(llm, llama_saved["prompts"])
        assert tokens(outs) == llama_saved["ref"]
        metrics = llm.get_metrics()
        assert metrics["kv_cache_dir_load_failures"] == 1 and metrics["prefix_cache_load_failures"] == 1
        assert metrics["prefix_cache_disk_hits"] > 0, "the good files before the bad one are still read"
        assert outs[0].num_cached_tokens >= 3 * LLAMA_BLOCK
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(victim in m and word in m for m in warnings), warnings
        # the same process never reads the bad file again
        caplog.clear()
        again = generate(llm, llama_saved["prompts"][:1])
        assert tokens(again) == llama_saved["ref"][:1] and again[0].num_cached_tokens > 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    if damage == "foreign":
        assert open(victim, "rb").read() == open(qwen2_file, "rb").read(), "a foreign file is left alone"
    else:
        # deleted, then saved again from the recomputed block: a later start-up reads it whole
        with LLM(llama_saved["path"], kv_cache_dir=cache_dir, **KW) as llm:
            out = generate(llm, llama_saved["prompts"][:1])[0]
            assert out.outputs[0].token_ids == llama_saved["ref"][0]
            assert out.num_cached_tokens == (len(prompt) - 1) // LLAMA_BLOCK * LLAMA_BLOCK
            assert llm.get_metrics()["kv_cache_dir_load_failures"] == 0


def test_load_failure_reports_only_the_tokens_not_recomputed(llama_saved, tmp_path):
    """A request whose saved block 3 is damaged starts over at the three blocks before it:
    its num_cached_tokens and the hit counters must count those, not the failed first hit."""
    cache_dir = str(tmp_path / "kv")
    shutil.copytree(llama_saved["dir"], cache_dir)
    prompt = llama_saved["prompts"][0]
    _flip(unit_path(cache_dir, llama_saved["identity"], prompt, 3))
    with LLM(llama_saved["path"], kv_cache_dir=cache_dir, **KW) as llm:
        out = generate(llm, [prompt])[0]
        metrics = llm.get_metrics()
    assert out.outputs[0].token_ids == llama_saved["ref"][0]
    assert out.num_cached_tokens == 3 * LLAMA_BLOCK, "tokens 48..95 were recomputed, not read from the cache"
    assert metrics["prefix_cache_hits"] == 3 * LLAMA_BLOCK
    assert metrics["prefix_cache_disk_hits"] == 3 * LLAMA_BLOCK


def test_snapshot_damage_on_a_ring_model(tiny_checkpoint, tmp_path, caplog):
    """A damaged snapshot file (rings, partial pages) is a logged miss too."""
    path = tiny_checkpoint("gemma3")
    prompts = prompts_for(49152, seed=9)
    cache_dir = str(tmp_path / "kv")
    with LLM(path, kv_cache_dir=cache_dir, num_blocks=32, **KW) as llm:
        ref = tokens(generate(llm, prompts))
    snapshots = [f for f in saved_files(cache_dir) if f.endswith(".snapshot.safetensors")]
    assert snapshots
    for f in snapshots:
        _flip(f)
    caplog.set_level(logging.WARNING)
    with LLM(path, kv_cache_dir=cache_dir, num_blocks=32, **KW) as llm:
        assert tokens(generate(llm, prompts)) == ref
        assert llm.get_metrics()["kv_cache_dir_load_failures"] >= 1
    assert any("damaged" in r.getMessage() for r in caplog.records)


def test_generate_after_close_serves_or_refuses_cleanly(llama_saved, tmp_path):
    """close() stops the directory's writer. A later generate() on the same LLM must either
    serve the requests (right tokens, no error) or refuse clearly; it must not fail healthy
    requests with a model-step fault because their step carried a save to the closed store."""
    cache_dir = str(tmp_path / "kv")
    llm = LLM(llama_saved["path"], kv_cache_dir=cache_dir, **KW)
    generate(llm, llama_saved["prompts"][:1])
    llm.close()
    try:
        outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in llama_saved["prompts"]]
    except (RuntimeError, ValueError) as e:
        assert "close" in str(e)
        return
    assert [o.error for o in outs] == [None, None], [str(o.error) for o in outs]
    assert tokens(outs) == llama_saved["ref"]
    llm.engine.kv_manager.check_no_leaks()


# ---- the directory's budget ----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_budget_is_never_exceeded(arch, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(arch)
    cache_dir, probe = str(tmp_path / "kv"), str(tmp_path / "probe")
    with LLM(path, kv_cache_dir=probe, num_blocks=32, **KW) as llm:
        generate(llm, prompts_for(49152, seed=1)[:1])
    sizes = [os.path.getsize(f) for f in saved_files(probe)]
    budget = 3 * max(sizes) + 100  # a few files
    prompts = prompts_for(49152, seed=2) + prompts_for(49152, seed=3)
    ref = None
    for _ in range(2):
        with LLM(path, kv_cache_dir=cache_dir, kv_cache_dir_size=budget, num_blocks=32, **KW) as llm:
            outs = tokens(generate(llm, prompts))
            ref = ref or outs
            assert outs == ref
            assert llm.engine.runner.caches.prefix.disk.files_evicted > 0
        assert 0 < dir_bytes(cache_dir) <= budget


def test_budget_eviction_keeps_a_usable_prefix(tiny_checkpoint, tmp_path):
    """A budget of three blocks under a six-block prompt: what is kept should be the head of
    the chain (a hit needs every block from the first), as the in-memory pool evicts a prefix's
    longest block first. Evicting by write time keeps the tail, which no lookup can reach."""
    path = tiny_checkpoint("llama")
    prompt = prompts_for(49152, seed=4)[0]  # 97 tokens: six full blocks
    probe = str(tmp_path / "probe")
    with LLM(path, kv_cache_dir=probe, **KW) as llm:
        generate(llm, [prompt])
    budget = 3 * max(os.path.getsize(f) for f in saved_files(probe)) + 100
    cache_dir = str(tmp_path / "kv")
    with LLM(path, kv_cache_dir=cache_dir, kv_cache_dir_size=budget, **KW) as llm:
        generate(llm, [prompt])
    assert dir_bytes(cache_dir) <= budget
    with LLM(path, kv_cache_dir=cache_dir, kv_cache_dir_size=budget, **KW) as llm:
        out = generate(llm, [prompt])[0]
    assert out.num_cached_tokens == 3 * LLAMA_BLOCK, "the three saved blocks should be the prefix's first three"


# ---- bad input at start-up ----------------------------------------------------------------------------

def test_unwritable_directory_is_refused(tiny_checkpoint, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_cache_dir"):
        LLM(tiny_checkpoint("llama"), kv_cache_dir=str(blocker / "kv"), **KW)
    with pytest.raises(ValueError, match="kv_cache_dir"):
        LLM(tiny_checkpoint("llama"), kv_cache_dir="", **KW)


@pytest.mark.parametrize("size", [1000, "1KiB", 0])
def test_budget_below_one_block_is_refused(size, tiny_checkpoint, tmp_path):
    """A tiny llama block is 8 KiB of rows."""
    with pytest.raises(ValueError, match="kv_cache_dir_size"):
        LLM(tiny_checkpoint("llama"), kv_cache_dir=str(tmp_path / "kv"), kv_cache_dir_size=size, **KW)


def test_non_string_cache_salt_is_refused(tiny_checkpoint, tmp_path):
    with LLM(tiny_checkpoint("llama"), kv_cache_dir=str(tmp_path / "kv"), **KW) as llm:
        for salt in (7, b"tenant", ["a"]):
            with pytest.raises(ValueError, match="cache_salt"):
                llm.engine.add_request([5, 6, 7], PARAMS, cache_salt=salt)
        assert not llm.engine.has_unfinished_requests()
        rid = llm.engine.add_request([5, 6, 7], PARAMS, cache_salt="tenant")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert rid
        llm.engine.kv_manager.check_no_leaks()
