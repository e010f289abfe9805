"""The kernel-dispatch seam (layers/kernel_set.py): every kernel set provides every hook, the
attention backends share one step skeleton, the fused C++ ops choose once per call class,
DeepSeek-V4's layers take their kernels from the bound set (no per-module flags, no walks), and
GPT-OSS's MXFP4 experts and LoRA take theirs from it too."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from deepinfer.model_executor.layers import kernel_set as kernel_sets
from deepinfer.model_executor.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    GroupMetadata,
    PrefillSegment,
    TorchAttentionBackend,
)
from deepinfer.model_executor.layers.attention.triton_backend import TritonAttentionBackend
from deepinfer.model_executor.layers.kernel_set import (
    CPU_KERNELS,
    HOOKS,
    KERNEL_SETS,
    OPTIONAL_HOOKS,
    TORCH_KERNELS,
    TRITON_KERNELS,
    KernelSet,
    kernels_for,
)
from deepinfer.model_executor.layers.ops import fused, lora

V4_DIR = Path(kernel_sets.__file__).resolve().parents[1] / "models" / "deepseek_v4"
REQUIRED_HOOKS = tuple(hook for hook in HOOKS if hook not in OPTIONAL_HOOKS)


def test_every_kernel_set_provides_every_hook():
    assert set(KERNEL_SETS) == {"torch", "cpu", "triton"}
    assert set(HOOKS) == {"store_rows", "decode_attention", "prefill_attention", "sparse_mla", "indexer_scores",
                          "grouped_moe", "mxfp4_experts", "lora_op", "lora_delta"}
    for name, kernels in KERNEL_SETS.items():
        assert kernels.name == name
        missing = [hook for hook in REQUIRED_HOOKS if not callable(getattr(kernels, hook, None))]
        assert missing == [], f"kernel set {name!r} lacks {missing}"
    assert callable(TRITON_KERNELS.mxfp4_experts) and TORCH_KERNELS.mxfp4_experts is CPU_KERNELS.mxfp4_experts is None


@pytest.mark.parametrize("hook", REQUIRED_HOOKS)
def test_triton_hooks_take_the_torch_hooks_arguments(hook):
    """A Triton hook binds every positional argument list its torch hook accepts."""
    torch_params = inspect.signature(getattr(TORCH_KERNELS, hook)).parameters
    triton_sig = inspect.signature(getattr(TRITON_KERNELS, hook))
    triton_sig.bind(*range(len(torch_params)))  # TypeError when the arities disagree


def test_the_backends_share_one_skeleton():
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        assert "forward" not in vars(backend), f"{backend.__name__} copies the step skeleton"
    assert TritonAttentionBackend().kernels is TRITON_KERNELS
    assert kernels_for("torch", torch.device("cpu")) is CPU_KERNELS
    assert kernels_for("torch", torch.device("cuda")) is TORCH_KERNELS
    with pytest.raises(ValueError, match="backend must be 'torch' or 'triton', got 'auto'"):
        kernels_for("auto", torch.device("cpu"))


class _Rows:
    """A cache whose loads are recorded: rows [n, 2, 1, D] filled with the slot."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def load(self, slots):
        self.calls.append("load")
        return slots.float()[:, None, None, None].expand(-1, 2, 1, 4)  # [n, 2, 1, D]


def _recording_kernels(calls: list[str]) -> KernelSet:
    def record(name, result):
        return lambda *args: calls.append(name) or result(*args)

    return KernelSet("recording",
                     store_rows=record("store", lambda *a: None),
                     decode_attention=record("decode", lambda cache, q, *a: torch.full_like(q, 1.0)),
                     prefill_attention=record("prefill", lambda q, *a: torch.full_like(q, 2.0)),
                     sparse_mla=None, indexer_scores=None, grouped_moe=None, mxfp4_experts=None, lora_op=None,
                     lora_delta=None)


def test_the_skeleton_loads_stores_decodes_then_prefills():
    calls: list[str] = []
    q = torch.zeros(3, 2, 4)  # [T, H, D]: one decode query, then a chunk of two
    k = v = torch.zeros(3, 1, 4)
    seg = PrefillSegment(1, 3, torch.tensor([5, 6]), torch.tensor([0, 1]))
    group = GroupMetadata(None, torch.arange(3), None, torch.tensor([[0, 1]]), [seg])
    md = AttentionMetadata(torch.tensor([7, 2, 3]), 1, [group])
    out = AttentionBackend(_recording_kernels(calls)).forward(_Rows(calls), q, k, v, md, group, 1.0)
    assert calls == ["load", "store", "decode", "prefill"]
    assert out[0].eq(1.0).all() and out[1:].eq(2.0).all()


def test_a_fused_op_chooses_once_per_call_class(monkeypatch):
    ran = []
    op = fused.FusedOp(lambda isa, x: ran.append(("kernel", isa)), lambda x: (x.dtype, x.device.type),
                       lambda kind: kind == (torch.float32, "cpu"), lambda x: ran.append(("torch", 0)))
    monkeypatch.setattr(fused, "kernel_isa", lambda: 2)
    for _ in range(3):
        op(torch.zeros(2))
    op(torch.zeros(2, dtype=torch.bfloat16))
    monkeypatch.setattr(fused, "kernel_isa", lambda: 0)  # DEEPINFER_CPU_ISA=none: the torch function
    op(torch.zeros(2))
    assert ran == [("kernel", 2)] * 3 + [("torch", 0)] * 2
    assert len(op._picks) == 3  # fp32 at isa 2, bf16 at isa 2, fp32 at isa 0: one choice each


def _v4_sources() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text()) for p in sorted(V4_DIR.glob("*.py"))}


def test_v4_modules_have_no_triton_flag_and_no_hasattr_walk():
    sources = _v4_sources()
    assert {"moe.py", "indexer.py", "cached_attn.py", "model.py"} <= set(sources)
    for name, tree in sources.items():
        for node in ast.walk(tree):
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            assert ident != "use_triton", f"{name}:{node.lineno} names use_triton"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "hasattr", f"{name}:{node.lineno} calls hasattr"


def test_the_ast_check_sees_a_flag_and_a_walk():
    """The check above can fail: the old dispatch (a flag set by a hasattr walk) trips both rules."""
    old = ast.parse("for m in model.modules():\n    if hasattr(type(m), 'use_triton'):\n        m.use_triton = True")
    idents = {n.attr for n in ast.walk(old) if isinstance(n, ast.Attribute)}
    calls = {n.func.id for n in ast.walk(old) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "use_triton" in idents and "hasattr" in calls


def test_v4_binding_hands_the_kernel_set_to_every_layer():
    from models.deepseek_v4.v4_tiny import CSA, HCA, SLIDING, tiny_v4_config

    from deepinfer.model_executor.layers.fused_moe import FusedExperts
    from deepinfer.model_executor.models.deepseek_v4.cached_attn import CachedV4Attention
    from deepinfer.model_executor.models.deepseek_v4.indexer import IndexerScorer
    from deepinfer.model_executor.models.deepseek_v4.model import DeepseekV4ForCausalLM

    cfg = tiny_v4_config([SLIDING, CSA, HCA])
    cfg.num_nextn_predict_layers = 1
    model = DeepseekV4ForCausalLM(cfg)
    model.add_mtp()
    users = [m for m in model.modules() if isinstance(m, (CachedV4Attention, IndexerScorer, FusedExperts))]
    assert len(users) == 4 + 1 + 4  # attention (3 + MTP), one CSA indexer, experts (3 + MTP)
    assert all(m.kernels is CPU_KERNELS for m in users)  # before binding: the CPU default
    model._bind_kernels(TRITON_KERNELS)
    assert all(m.kernels is TRITON_KERNELS for m in users)


def test_lora_is_chosen_through_the_kernel_set(monkeypatch):
    """Each set's LoRA rule, on the devices the engine gives it, is the one rule `lora_op_name` states
    for every device (what ran before the choice moved into the set)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(lora, "lora_cpu_isa", lambda: "avx2")
    for dtype in (torch.float32, torch.bfloat16):
        assert CPU_KERNELS.lora_op(cpu, dtype) == TRITON_KERNELS.lora_op(cpu, dtype) == lora.lora_op_name(cpu, dtype)
        rule = lora.lora_op_name(cuda, dtype)
        assert TORCH_KERNELS.lora_op(cuda, dtype) == TRITON_KERNELS.lora_op(cuda, dtype) == rule
    assert CPU_KERNELS.lora_op(cpu, torch.float32) == "cpu_kernel"
    assert CPU_KERNELS.lora_op(cpu, torch.bfloat16) == "torch"
    monkeypatch.setattr(lora, "lora_cpu_isa", lambda: None)  # no C++ kernel: the reference
    assert CPU_KERNELS.lora_op(cpu, torch.float32) == "torch"
    x, slot = torch.randn(3, 8), torch.tensor([0, -1, 0])
    a, b, scale = torch.randn(1, 2, 8), torch.randn(1, 4, 2), torch.ones(1)
    assert torch.equal(CPU_KERNELS.lora_delta(x, slot, a, b, scale), lora.lora_delta_ref(x, slot, a, b, scale))


def test_mxfp4_experts_take_the_bound_sets_hook():
    from deepinfer.model_executor.layers.mxfp4_moe import OssExperts

    packed = OssExperts(4, 32, 32, packed=True, swiglu_limit=7.0)
    dense = OssExperts(4, 32, 32, packed=False, swiglu_limit=7.0)
    for experts in (packed, dense):
        assert experts.grouped_mxfp4 is None  # unbound: the per-expert loop
        experts.bind_kernels(TRITON_KERNELS)
    assert packed.grouped_mxfp4 is TRITON_KERNELS.mxfp4_experts and dense.grouped_mxfp4 is None
    packed.bind_kernels(CPU_KERNELS)
    assert packed.grouped_mxfp4 is None
