"""The Triton LoRA kernels (kernels/triton_lora.py) run by Triton's interpreter on CPU tensors, against torch's
segmented gather-matmul they replace on CUDA (kernels/lora.py's `add_lora`): mixed batches of several adapters and
base rows, fused projections' stacked slots (the expand reads only each module's rank rows of the block-diagonal
B^T), groups longer than one block of rows, widths that end mid-tile.
Small shapes: the interpreter runs each program in numpy. Triton decides between compiling and interpreting when it
is imported, so the kernel runs in a process started with TRITON_INTERPRET=1 (the `interpreter` fixture)."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import slot_table

from mili_openai.kernels.lora import LoraRows, LoraSlotTable, add_lora, lora_groups

pytest.importorskip("triton")


def _triton_add_lora(out: torch.Tensor, x: torch.Tensor, table: LoraSlotTable, row_slots: list[int]) -> torch.Tensor:
    from mili_openai.kernels import triton_lora

    assert type(triton_lora._lora_shrink).__name__ == "InterpretedFunction", "the interpreter did not take over"
    rows = LoraRows(lora_groups(row_slots, x.device))
    assert triton_lora.triton_add_lora(out, x, table, rows) is out
    return out


CASES = [
    (64, [48, 16, 16], 8, [2, -1, 0, 2, 2, -1, 1]),  # q, k, v stacked; rows sharing a slot; base rows
    (32, [7, 9], 4, [1, 1, 1]),  # module widths that end mid-tile; one adapter on every row
    (96, [40], 16, [-1, 0]),
    (80, [72], 8, [0] * 20 + [-1] * 3 + [1] * 17),  # groups over one block of rows; 80 features: a partial K tile
    (32, [70, 30, 8, 8], 4, [1, 0, -1, 1]),  # Gated DeltaNet's four inputs: a column tile of one module, one of four
]


@pytest.mark.parametrize("in_features, module_outs, rank, row_slots", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_segmented_matmul(interpreter, in_features, module_outs, rank, row_slots, dtype):
    table = slot_table(3, in_features, module_outs, rank, seed=in_features, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(len(row_slots), in_features, generator=generator).to(dtype)
    base = torch.randn(len(row_slots), table.offsets[-1], generator=generator).to(dtype)
    want = add_lora(base.clone(), x, table, LoraRows(lora_groups(row_slots, x.device)))
    got = interpreter.submit(_triton_add_lora, base.clone(), x, table, row_slots).result()
    assert got.dtype == dtype and got.shape == want.shape
    base_rows = [row for row, slot in enumerate(row_slots) if slot == -1]
    assert torch.equal(got[base_rows], base[base_rows])  # rows on the base alone are untouched
    if dtype == torch.float32:  # the same products, summed in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the interpreter truncates float32 to bf16 where torch rounds: a step or two of bf16 apart
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * float(want.float().abs().max()))


def test_no_adapter_rows_leave_the_output_alone(interpreter):
    table = slot_table(2, 32, [16], 8, seed=3, dtype=torch.float32)
    x, base = torch.randn(4, 32), torch.randn(4, 16)
    got = interpreter.submit(_triton_add_lora, base.clone(), x, table, [-1, -1, -1, -1]).result()
    assert torch.equal(got, base)


class _Unbuildable:
    def __call__(self, *args):
        raise RuntimeError("PassManager::run failed")  # what a Triton too old for a kernel raises


def test_the_kernel_is_kept_only_where_it_builds(tiny_checkpoint, caplog):
    from mili_openai.model.backend_setup import _lora_kernel_compiles
    from mili_openai.model.loader import load_model

    model, _ = load_model(tiny_checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    assert _lora_kernel_compiles(add_lora, model)
    assert not _lora_kernel_compiles(_Unbuildable(), model)
    assert "PassManager::run failed" in caplog.text and "adapters run as torch matmuls" in caplog.text


def _bucket_add_lora(out: torch.Tensor, x: torch.Tensor, table: LoraSlotTable, row_slots: list[int],
                     num_slots: int) -> list[torch.Tensor]:
    """The kernel over a CUDA graph bucket of out's rows (kernels/lora.py's BucketLoraRows), the step being the
    first len(row_slots) rows, filled step after step as a replayed graph's buffers are: each step's result."""
    from mili_openai.kernels import triton_lora
    from mili_openai.kernels.lora import BucketLoraRows

    bucket = BucketLoraRows(out.shape[0], num_slots, triton_lora.BLOCK_ROWS, x.device)
    results = []
    for step in (row_slots, [-1] * len(row_slots), row_slots[::-1]):  # a step with no adapter row in between
        bucket.fill(lora_groups(step, x.device), len(step), x.device)
        results.append(triton_lora.triton_add_lora(out.clone(), x, table, bucket))
    return results


@pytest.mark.parametrize("row_slots", [[2, -1, 0, 2, 2, -1, 1], [0] * 20 + [-1] * 3 + [1] * 17, [1, 1, 1]])
def test_a_graph_buckets_static_blocks_give_each_steps_result(interpreter, row_slots):
    """A bucket padded past the step's rows: the step's rows as the step's own blocks give them, the padded rows
    untouched, whatever the step before left in the static blocks."""
    table = slot_table(3, 48, [24, 8], 8, seed=5, dtype=torch.float32)
    rows = len(row_slots) + 5  # padded rows past the step's
    generator = torch.Generator().manual_seed(2)
    x, base = torch.randn(rows, 48, generator=generator), torch.randn(rows, 32, generator=generator)
    results = interpreter.submit(_bucket_add_lora, base, x, table, row_slots, 3).result()
    for got, step in zip(results, (row_slots, [-1] * len(row_slots), row_slots[::-1])):
        padded = step + [-1] * 5
        want = add_lora(base.clone(), x, table, LoraRows(lora_groups(padded, x.device)))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[len(step):], base[len(step):])
