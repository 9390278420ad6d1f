"""Evaluation on several processes: equal shards (every `generate` call is a collective under
ZeRO-3 and FSDP), the gathered records without the padding, and the model on the accelerator's
device before the first evaluation."""

from types import SimpleNamespace

import torch

from trl_grpo_ext.evaluation import place_on_device, shard_indices, unpad


def test_shards_are_padded_to_the_same_length_and_unpadded_after_gathering():
    shards = [shard_indices(7, rank, 2) for rank in (0, 1)]
    assert shards == [[0, 2, 4, 6], [1, 3, 5, 1]]  # problem 1 again, to make 4 calls
    gathered = [index for shard in shards for index in shard]  # gather_object's order
    assert unpad(gathered, 7, 2) == [0, 2, 4, 6, 1, 3, 5]
    shards = [shard_indices(2, rank, 3) for rank in (0, 1, 2)]
    assert shards == [[0], [1], [0]]  # more processes than problems
    assert unpad([i for shard in shards for i in shard], 2, 3) == [0, 1]
    assert shard_indices(6, 0, 1) == list(range(6)) and unpad(list(range(6)), 6, 1) == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]


def fake_trainer(model, device):
    accelerator = SimpleNamespace(device=torch.device(device), unwrap_model=lambda m: m)
    return SimpleNamespace(accelerator=accelerator, model=model)


def test_the_model_goes_to_the_accelerators_device_before_evaluating():
    """Under DeepSpeed and FSDP the Trainer moves the model only in `train()`; the evaluation
    before training would otherwise generate on the CPU. (`meta` stands in for a GPU.)"""
    model = torch.nn.Linear(2, 2)
    assert place_on_device(fake_trainer(model, "meta")) is model
    assert model.weight.device.type == "meta"


def test_partitioned_weights_stay_where_they_are():
    """ZeRO-3's partitioned parameters (`ds_id`) are gathered by the engine, never moved."""
    model = torch.nn.Linear(2, 2)
    model.weight.ds_id = 0
    place_on_device(fake_trainer(model, "meta"))
    assert model.weight.device.type == "cpu"
