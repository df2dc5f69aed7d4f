"""No Triton compile under load: every kernel launch of a serving step is a variant the load-time warm-up
(model/kernel_warmup.py) compiled.

Run by tests/kernels/test_triton_interpreted.py in its TRITON_INTERPRET=1 subprocess, as triton_attention_cases.py is
(on a GPU machine, directly: the same checks on CUDA). Each launch's arguments are recorded through
Triton's pre-run hooks, and the key Triton's JIT would compile a variant for is computed from them with
Triton's own specialisation function and each kernel's do_not_specialize flags.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import PagedSequences, random_tokens

pytest.importorskip("triton")

from triton_attention_cases import DEVICE  # noqa: E402

from mili_openai.kernels.triton_attention import TritonAttention  # noqa: E402
from mili_openai.model import KVCache, ModelCaches, load_model  # noqa: E402


def _kernel_params(kernel) -> list:
    """The kernel's parameters as Triton's JIT sees them (name, constexpr, do_not_specialize flags); the
    interpreter keeps only the decorator's arguments, from which the same JIT object is built."""
    from triton.runtime.jit import JITFunction

    return kernel.params if hasattr(kernel, "params") else JITFunction(kernel.fn, **kernel.kwargs).params


def specialization_key(params: list, args: tuple, kwargs: dict, specialize_all: bool = False) -> tuple:
    """What Triton's JIT keys a compiled variant on: each constexpr's value, and each other argument's type
    with the value class (1, divisible by 16, other) or 16-byte alignment it is specialised on, unless the
    kernel leaves it unspecialised. `specialize_all`: as if it left none."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    values = dict(zip((p.name for p in params), args)) | kwargs
    key = []
    for param in params:
        value = values[param.name]
        if param.is_constexpr:
            key.append((param.name, value))
        else:
            specialize = specialize_all or not param.do_not_specialize
            align = specialize_all or not param.do_not_specialize_on_alignment
            key.append((param.name, *native_specialize_impl(BaseBackend, value, False, specialize, align)))
    return tuple(key)


class LaunchRecorder:
    """Records each launch's arguments of the serving path's kernels (Triton's pre-run hooks)."""

    def __init__(self, kernels: list) -> None:
        self.kernels = kernels
        self.launches: list[tuple[object, tuple, dict]] = []
        self.hooks = [lambda *args, kernel=kernel, **kwargs: self.launches.append((kernel, args, kwargs))
                      for kernel in kernels]

    def __enter__(self) -> LaunchRecorder:
        for kernel, hook in zip(self.kernels, self.hooks):
            kernel.add_pre_run_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        for kernel, hook in zip(self.kernels, self.hooks):
            kernel.pre_run_hooks.remove(hook)

    def keys(self, specialize_all: bool = False) -> dict[str, set[tuple]]:
        """{kernel name: its launches' specialization keys}."""
        keys: dict[str, set[tuple]] = {}
        for kernel, args, kwargs in self.launches:
            params = _kernel_params(kernel)
            names = {p.name for p in params}
            key = specialization_key(params, args, {k: v for k, v in kwargs.items() if k in names}, specialize_all)
            keys.setdefault(kernel.__name__, set()).add(key)
        return keys


@torch.inference_mode()
def test_serving_steps_launch_only_the_variants_the_warm_up_compiled(tiny_checkpoint):
    """Steps whose page tables differ in width and whose index tensors sit at varying offsets of the staged
    step buffer (as the runner hands them to the GPU) meet no kernel variant the load-time warm-up did not:
    nothing compiles after start-up. Without the kernels' do_not_specialize lists they would."""
    from mili_openai.engine.step_inputs import forward_batch_to, stage_forward_batch
    from mili_openai.kernels import triton_attention_kernels, triton_fused_ops
    from mili_openai.model.kernel_warmup import warm_up_kernels

    model, config = load_model(tiny_checkpoint, torch.float32, DEVICE, attention_backend="triton")
    attention = TritonAttention(multiprocessors=2)  # few decode rows reach every split count
    model.backend.attention = attention
    fused = triton_fused_ops.TritonFusedOps()
    model.backend.fused_ops = model.backend.residual_norm = fused
    kernels = [triton_attention_kernels.decode_partial_kernel, triton_attention_kernels.decode_reduce_kernel,
               triton_attention_kernels.extend_kernel, triton_fused_ops._rms_norm_kernel,
               triton_fused_ops._add_rms_norm_kernel, triton_fused_ops._qk_norm_rope_kernel,
               triton_fused_ops._silu_mul_kernel]
    with LaunchRecorder(kernels) as warm_up:
        warm_up_kernels(model, config, attention.decode_split_rows(config.num_key_value_heads), DEVICE)
    compiled = warm_up.keys()
    assert set(compiled) == {kernel.__name__ for kernel in kernels}

    page_size = 4
    sequences = PagedSequences(num_pages=96, page_size=page_size, seed=5)
    cache = ModelCaches(KVCache(model.cache_specs(), 96, page_size, torch.float32, DEVICE))
    for key, length in (("a", 40), ("b", 20), ("c", 50), ("d", 20), ("e", 70)):
        sequences.add(key, random_tokens(length, seed=len(key) + length))
    # (decode keys, prefill chunks): tables 1 to 16 pages wide (16: a width divisible by 16), 8 tokens (48 q/k
    # rows: a count divisible by 16) and others
    steps = [
        ([], [("a", 21), ("b", 5)]), (["a", "b"], [("c", 13)]), (["a"], [("d", 7)]), (["a"], []),
        (["a", "b"], [("c", 10), ("d", 2)]),
        (["a", "b", "c", "d"], []), (["b"], [("c", 7), ("e", 61)]), (["d", "c"], []), (["e", "d"], [("c", 3)]),
    ]
    with LaunchRecorder(kernels) as serving:
        for decode, prefill in steps:
            batch, _ = sequences.batch(decode=decode, prefill=prefill)
            # as the runner hands a step over: index tensors at their offsets in one staged buffer
            staged, buffer = stage_forward_batch(batch, pin_memory=False)
            model(forward_batch_to(staged, DEVICE, buffer), cache)
    keys, naive = serving.keys(), serving.keys(specialize_all=True)
    for name in keys:
        assert keys[name] <= compiled[name], f"{name} would compile under load"
        # launches with the same constexprs (block sizes, split count) share one variant
        assert len(keys[name]) == len({constexprs(key) for key in keys[name]}), name
    # and the steps do vary what Triton could key on
    for name in ("decode_partial_kernel", "extend_kernel", "_qk_norm_rope_kernel"):
        assert len(naive[name]) > len(keys[name]), name


def constexprs(key: tuple) -> tuple:
    """The constexpr values of a specialization key (entries of two: a name and a value)."""
    return tuple(entry for entry in key if len(entry) == 2)


@torch.inference_mode()
def test_hybrid_serving_steps_launch_only_the_variants_the_warm_up_compiled(hybrid_checkpoint):
    """The same on a Qwen3.5 model: its Gated DeltaNet kernels take each step's state slots from the staged index
    buffer, at an offset that follows the step's token count; the warm-up (with a scratch state pool) compiled
    every variant the steps launch. On an H200 (2026-11-30) a server without this compiled the chunked delta rule
    again for a 512-token prompt after a 513-token one (ptxas ~35 s, mid-request)."""
    from hybrid_helpers import hybrid_tokens, with_state_slots

    from mili_openai.engine.step_inputs import forward_batch_to, stage_forward_batch
    from mili_openai.kernels import triton_gated_delta_rule as gdn
    from mili_openai.model.kernel_warmup import warm_up_kernels
    from mili_openai.model.state_cache import StateCache

    model, config = load_model(hybrid_checkpoint("qwen3_5"), torch.float32, DEVICE, attention_backend="triton")
    attention = TritonAttention(multiprocessors=2)
    model.backend.attention = attention
    model.backend.linear_attention = gdn.TritonLinearAttention()  # on CUDA set at load; here by hand
    kernels = [gdn.delta_rule_decode_kernel, gdn.delta_rule_prefill_kernel, gdn.conv_decode_kernel,
               gdn.conv_prefill_kernel, gdn.conv_window_kernel]
    with LaunchRecorder(kernels) as warm_up:
        warm_up_kernels(model, config, attention.decode_split_rows(config.num_key_value_heads), DEVICE)
    compiled = warm_up.keys()
    assert set(compiled) == {kernel.__name__ for kernel in kernels}

    page_size, slots = 4, {"a": 0, "b": 1, "c": 2, "d": 3}
    sequences = PagedSequences(num_pages=64, page_size=page_size, seed=5)
    specs = model.cache_specs()
    cache = ModelCaches(KVCache(specs, 64, page_size, torch.float32, DEVICE),
                        StateCache(specs, len(slots), torch.float32, DEVICE))
    for key, length in (("a", 30), ("b", 21), ("c", 33), ("d", 9)):
        sequences.add(key, hybrid_tokens(length, seed=len(key) + length))
    # token counts odd and even, so the staged state slots sit at 8- and 16-byte aligned offsets
    steps = [([], [("a", 21), ("b", 4)]), (["a"], [("c", 16)]), (["a", "b"], [("d", 5), ("c", 3)]),
             (["a", "b", "c"], []), (["d"], [("b", 8)]), (["a", "b", "c", "d"], [])]
    with LaunchRecorder(kernels) as serving:
        for decode, prefill in steps:
            batch, _ = sequences.batch(decode=decode, prefill=prefill)
            staged, buffer = stage_forward_batch(with_state_slots(batch, decode, prefill, slots), pin_memory=False)
            model(forward_batch_to(staged, DEVICE, buffer), cache)
    keys, naive = serving.keys(), serving.keys(specialize_all=True)
    for name in keys:
        assert keys[name] <= compiled[name], f"{name} would compile under load"
    # without the kernels' do_not_specialize lists, the steps' state slots would compile new variants
    warmed_naive = warm_up.keys(specialize_all=True)
    for name in ("delta_rule_prefill_kernel", "delta_rule_decode_kernel"):
        assert not naive[name] <= warmed_naive[name], name
