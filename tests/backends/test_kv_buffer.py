"""The in-place KV layer holds exactly what transformers' concatenating DynamicLayer holds."""

import pytest
import torch
from tiny_models import tiny_model
from transformers.cache_utils import DynamicLayer

from spec_rl.backends.hf_decode import cache_argument, prefill
from spec_rl.backends.kv_buffer import MIN_SPARE, InPlaceLayer, buffer_columns, in_place_cache, left_padded_cache
from spec_rl.sampling.groups import RowContext


def _random_kv(gen, rows, width, heads=2, dim=3):
    shape = (rows, heads, width, dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(
        shape, generator=gen, dtype=torch.float64
    )


@pytest.mark.parametrize("start", [0, 1, 5, 130])
def test_appends_equal_torch_cat_through_growth_selection_and_crop(start):
    gen = torch.Generator().manual_seed(start)
    k0, v0 = _random_kv(gen, 4, start)
    mine, ref = InPlaceLayer(k0, v0), DynamicLayer()
    ref.update(k0, v0)
    widths = [1, 9, 1, MIN_SPARE + 7, 2, 1, 3]  # one append larger than any spare
    for step, w in enumerate(widths):
        rows = mine.keys.shape[0]
        k, v = _random_kv(gen, rows, w)
        got, want = mine.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step == 2:  # a row leaves the batch
            keep = torch.tensor([0, 2, 3])
            mine.batch_select_indices(keep)
            ref.batch_select_indices(keep)
        if step == 4:  # a rollback of the last column
            mine.crop(-1)
            ref.crop(-1)
        if step == 5:  # left padding no row needs is dropped
            mine.drop_front(3)
            ref.keys, ref.values = ref.keys[:, :, 3:], ref.values[:, :, 3:]
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
        assert mine.get_seq_length() == ref.get_seq_length()


def test_earlier_views_keep_their_values_and_replaced_tensors_are_adopted():
    gen = torch.Generator().manual_seed(1)
    k0, v0 = _random_kv(gen, 2, 3)
    layer = InPlaceLayer(k0, v0)
    seen = layer.keys.clone()
    old_view = layer.keys
    layer.update(*_random_kv(gen, 2, 4))
    assert torch.equal(old_view, seen)  # appends write only past the views handed out before
    layer.batch_repeat_interleave(2)  # a base-class method that replaces keys/values with new tensors
    k, v = _random_kv(gen, 4, 1)
    keys, values = layer.update(k, v)
    assert keys.shape == (4, 2, 8, 3) and torch.equal(keys[:, :, -1:], k) and torch.equal(values[:, :, -1:], v)
    assert torch.equal(keys[1, :, :3], k0[0])  # row 0 repeated, then the new column


def test_decode_forward_over_the_in_place_cache_equals_a_plain_forward():
    model = tiny_model(seed=4).double()
    contexts = [[3, 4, 5, 6], [7, 8], [3, 4, 5, 6]]
    kv, _ = prefill(model, contexts, pad_id=0)
    assert all(isinstance(layer, InPlaceLayer) for layer in kv.cache.layers)
    new = torch.tensor([[9], [10], [11]])
    mask = torch.cat([kv.mask, torch.ones((3, 1), dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1)[:, -1:]
    with torch.no_grad():
        out = model(
            input_ids=new, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_argument(model): kv.cache}
        )
        for row, ctx in enumerate(contexts):
            full = model(input_ids=torch.tensor([ctx + new[row].tolist()])).logits[0, -1]
            assert torch.allclose(out.logits[row, -1], full, atol=1e-10)


def test_in_place_cache_copies_what_it_is_given():
    k, v = _random_kv(torch.Generator().manual_seed(2), 1, 2)
    cache = in_place_cache([(k, v)])
    k.zero_()
    assert cache.layers[0].keys.abs().sum() > 0


def test_reset_then_update_and_selecting_rows_of_an_empty_layer_behave_like_dynamic_layer():
    gen = torch.Generator().manual_seed(3)
    k0, v0 = _random_kv(gen, 2, 3)
    mine, ref = InPlaceLayer(k0, v0), DynamicLayer()
    ref.update(k0, v0)
    mine.reset()
    ref.reset()
    k, v = _random_kv(gen, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(mine.update(k, v), ref.update(k, v)))
    empty = InPlaceLayer(*_random_kv(gen, 3, 0))
    empty.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert empty.keys.shape == (3, 2, 0, 3)  # DynamicLayer leaves an empty layer as it is


@pytest.mark.parametrize("lengths", [[5], [3, 7, 1], [4, 4], [0, 2]])
def test_left_padded_cache_right_aligns_each_row_and_appends_in_place(lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    rows = [[_random_kv(gen, 1, n) for _ in range(2)] for n in lengths]  # 2 layers of [1, H, n, D]
    rows = [RowContext(layers, 0, torch.arange(n)) for layers, n in zip(rows, lengths)]
    cache, mask = left_padded_cache(rows)
    width = max(lengths)
    assert mask.dtype == torch.long and mask.tolist() == [[int(c >= width - n) for c in range(width)] for n in lengths]
    for layer_i, layer in enumerate(cache.layers):
        assert isinstance(layer, InPlaceLayer) and layer._key_buffer.shape[2] == buffer_columns(width)
        for b, n in enumerate(lengths):
            for got, want in zip((layer.keys, layer.values), rows[b][layer_i]):
                assert torch.equal(got[b, :, width - n :], want)
                assert torch.count_nonzero(got[b, :, : width - n]) == 0  # padding is zero, never garbage
        ref = DynamicLayer()
        ref.update(layer.keys.clone(), layer.values.clone())
        k, v = _random_kv(gen, len(lengths), 3)
        assert all(torch.equal(a, c) for a, c in zip(layer.update(k, v), ref.update(k, v)))  # within the spare columns


def test_owning_takes_the_buffers_without_a_copy():
    k, v = _random_kv(torch.Generator().manual_seed(5), 2, 4)
    layer = InPlaceLayer.owning(k, v, 4)
    assert layer.keys.data_ptr() == k.data_ptr() and layer.values.data_ptr() == v.data_ptr()
