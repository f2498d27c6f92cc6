import torch

from asyncengine.lora.grouped import add_lora, row_groups


def test_groups_sort_the_adapter_rows_by_slot():
    g = row_groups(torch.tensor([-1, 0, 0, 1, -1, 1]))
    assert g.rows.tolist() == [1, 2, 3, 5] and g.spans == [(0, 0, 2), (1, 2, 4)] and g.num_rows == 4
    g = row_groups(torch.tensor([1, 0, -1, 0]))
    assert g.rows.tolist() == [1, 3, 0] and g.spans == [(0, 0, 2), (1, 2, 3)]
    g = row_groups(torch.tensor([0, 0, 2, -1]))  # already in slot order from row 0: no gather
    assert g.rows is None and g.spans == [(0, 0, 2), (2, 2, 3)] and g.num_rows == 3
    assert row_groups(torch.tensor([-1, -1])) is None


def test_grouped_equals_per_row_and_base_rows_untouched():
    torch.manual_seed(0)
    slots, rank, fin, fout, t = 3, 4, 16, 24, 10
    a, b = torch.randn(slots, rank, fin), torch.randn(slots, fout, rank)
    x, y = torch.randn(t, fin), torch.randn(t, fout)
    row_slots = torch.tensor([2, -1, 0, 2, 1, -1, 0, 0, 2, -1])
    want = y.clone()
    for i, s in enumerate(row_slots.tolist()):
        if s >= 0:
            want[i] += b[s] @ (a[s] @ x[i])
    got = add_lora(y.clone(), x, row_groups(row_slots), a, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = row_slots == -1
    assert torch.equal(got[base], y[base])
    sorted_slots = torch.tensor([0, 0, 1, 2, 2, -1, -1, -1, -1, -1])  # the no-gather path
    want = y.clone()
    for i, s in enumerate(sorted_slots.tolist()):
        if s >= 0:
            want[i] += b[s] @ (a[s] @ x[i])
    torch.testing.assert_close(add_lora(y.clone(), x, row_groups(sorted_slots), a, b), want, rtol=1e-5, atol=1e-5)
