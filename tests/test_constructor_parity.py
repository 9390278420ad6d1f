"""GroupRelativeTrainer's constructor takes every argument of trl.GRPOTrainer's, with TRL's
name, kind, default and order, so a TRL script switches by changing its import; and
`quantization_config` reaches model loading as in TRL."""

import inspect

import pytest
import trl
from packaging.version import Version
from trainer_helpers import digit_sums, odd_first_byte

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import tiny_model_and_tokenizer


def _parameters(cls):
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]


@pytest.mark.skipif(
    Version(trl.__version__) < Version("1.16"),
    reason=f"compares with trl.GRPOTrainer's 1.16 argument list, found trl {trl.__version__}",
)
def test_every_trl_constructor_argument_exists_here_with_trls_kind_and_default():
    theirs = _parameters(trl.GRPOTrainer)
    ours = {p.name: p for p in _parameters(GroupRelativeTrainer)}
    missing = [p.name for p in theirs if p.name not in ours]
    assert not missing, f"trl.GRPOTrainer takes {missing}, GroupRelativeTrainer does not"
    for parameter in theirs:
        mine = ours[parameter.name]
        assert mine.kind == parameter.kind, parameter.name
        assert mine.default == parameter.default, (parameter.name, mine.default)
    # Same order, so that positional calls mean the same; ours adds nothing in between.
    shared = [p.name for p in theirs if p.name in ours]
    assert [name for name in ours if name in shared] == shared
    assert list(ours)[: len(shared)] == shared


# ---------------------------------------------------------------------- quantization_config


def _record_loading(monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, path, *args, **kwargs):
        calls.append(dict(kwargs))
        kwargs.pop("quantization_config", None)  # the plumbing only: no bitsandbytes on CPU
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    return calls


def _args(tmp_path, **kwargs):
    return GroupRelativeConfig(
        str(tmp_path), num_generations=4, per_device_train_batch_size=8, report_to="none", **kwargs
    )


def test_quantization_config_reaches_from_pretrained(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import BitsAndBytesConfig

    calls = _record_loading(monkeypatch)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    GroupRelativeTrainer(
        tiny_model_dir, odd_first_byte, args=_args(tmp_path, model_init_kwargs={"dtype": "float32"}),
        train_dataset=digit_sums(),
        quantization_config=quantization,
    )  # fmt: skip
    assert len(calls) == 1
    assert calls[0]["quantization_config"] is quantization
    assert calls[0]["dtype"] == "float32"  # model_init_kwargs still apply
    calls.clear()
    GroupRelativeTrainer(
        tiny_model_dir, odd_first_byte, args=_args(tmp_path), train_dataset=digit_sums()
    )
    assert "quantization_config" not in calls[0]


def test_quantization_config_in_two_places_is_an_error(tmp_path, tiny_model_dir):
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True)
    args = _args(tmp_path, model_init_kwargs={"quantization_config": {"load_in_4bit": True}})
    with pytest.raises(ValueError, match="both as a trainer argument and in"):
        GroupRelativeTrainer(
            tiny_model_dir,
            odd_first_byte,
            args=args,
            quantization_config=quantization,
            train_dataset=digit_sums(),
        )


def test_quantization_config_with_a_model_object_says_what_to_do(tmp_path):
    from transformers import BitsAndBytesConfig

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match="loaded already.*from_pretrained"):
        GroupRelativeTrainer(
            model, odd_first_byte, args=_args(tmp_path), processing_class=tokenizer,
            train_dataset=digit_sums(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )  # fmt: skip
