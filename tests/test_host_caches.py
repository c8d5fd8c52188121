"""What the training step's host path keeps between calls, and when it lets go of it: each
cache gives what a fresh computation would, and is dropped when what it depends on
changes (tables added or removed, a learning rate changed, a table growing)."""

import pytest
import torch

from sokpy.nn.kjt import KeyedTensor


def test_keyed_tensor_items_are_the_features_slices_with_their_gradients():
    """``kt[key]`` is the feature's slice, as its ``to_dict()`` entry (along either key
    dimension), and the gradient of a loss over items reaches the values."""
    values = torch.arange(12.0).reshape(3, 4).requires_grad_()
    kt = KeyedTensor(["a", "b", "c"], [1, 2, 1], values)
    want = kt.to_dict()
    for key in ("c", "a", "b", "b"):
        assert torch.equal(kt[key], want[key])
    (kt["a"].sum() + 2 * kt["b"].sum()).backward()
    assert values.grad.tolist() == [[1.0, 2.0, 2.0, 0.0]] * 3
    rows = KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).reshape(3, 2), key_dim=0)
    assert rows["y"].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(KeyError, match="no key 'd'"):
        kt["d"]
