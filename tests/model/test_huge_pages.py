"""Weights and KV pools on huge-page memory: same values, same sharing, aligned arenas."""

from __future__ import annotations

import torch
from torch import nn

from mili_openai.model.huge_pages import HUGE_PAGE_BYTES, huge_page_zeros, move_parameters_to_huge_pages


def test_huge_page_zeros_is_zeros_on_a_huge_page_boundary():
    pool = huge_page_zeros((3, 2, 5, 7), torch.bfloat16)
    assert pool.shape == (3, 2, 5, 7) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not pool.any()
    pool.fill_(1.5)  # writable, and the memory outlives the function that mapped it
    assert float(pool.float().sum()) == 1.5 * pool.numel()


def test_parameters_move_with_their_values_and_ties():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 24), nn.Linear(24, 24), nn.LayerNorm(24), nn.Linear(24, 50, bias=False))
    model[3].weight = model[0].weight  # tied, as Qwen3's embedding and LM head
    model.requires_grad_(False)
    before = {name: p.clone() for name, p in model.named_parameters(remove_duplicate=False)}
    old_pointers = {p.data_ptr() for p in model.parameters()}
    x = torch.randint(0, 50, (4,))
    want = model(x)

    move_parameters_to_huge_pages(model)

    params = list(model.parameters())
    assert {p.data_ptr() for p in params}.isdisjoint(old_pointers)
    assert params[0].data_ptr() % HUGE_PAGE_BYTES == 0  # the arena starts on a huge page
    assert all(p.data_ptr() % 64 == 0 for p in params)
    assert model[3].weight is model[0].weight
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, before[name]), name
    assert torch.equal(model(x), want)
