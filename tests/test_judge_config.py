"""`reward_funcs: [judge]` in a recipe config: the `judge_*` arguments build `judge_reward`, whose
server is checked before training (`script_args.judge_from_arguments`), against the stub judge
of conftest.py. The preset recipes/configs/smollm2_judge_cpu.yaml is the config read."""

import os
import socket

import pytest

from trl_grpo_ext.script_args import load_rewards, make_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "recipes", "configs", "smollm2_judge_cpu.yaml")
JUDGE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the preset's judge_model


def preset_arguments(*overrides):
    script_args, *_ = make_parser().parse_args_and_config(["--config", PRESET, *overrides])
    return script_args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_preset_builds_a_judge_that_asks_its_server(stub_factory, tmp_path):
    stub = stub_factory(lambda body: "Score: 7", models=(JUDGE_MODEL,))
    script_args = preset_arguments(
        "--judge_base_url", stub.base_url, "--judge_cache_dir", str(tmp_path)
    )
    accuracy, judge = load_rewards(script_args)
    assert [accuracy.__name__, judge.__name__] == ["math_accuracy", "judge"]
    assert stub.bodies == []  # the check asked for the models only
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
    completions = [[{"role": "assistant", "content": c}] for c in ("5", "It is 5.")]
    assert judge(prompts=prompts, completions=completions) == [0.7, 0.7]
    body = stub.bodies[0]
    # what the preset says: its model, rubric, reply cap and vLLM's structured outputs
    assert body["model"] == JUDGE_MODEL and body["max_tokens"] == 8
    assert "single number and nothing else" in body["messages"][0]["content"]
    assert body["structured_outputs"] == {"regex": "Score: (10|[0-9])"}
    assert len(os.listdir(tmp_path)) == 2  # judgments kept where judge_cache_dir says


def test_an_unreachable_judge_stops_the_run_naming_host_and_port():
    port = free_port()
    script_args = preset_arguments("--judge_base_url", f"http://127.0.0.1:{port}/v1")
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        load_rewards(script_args)


def test_a_model_the_server_does_not_serve_is_named_with_those_it_does(stub_factory):
    stub = stub_factory(lambda body: "Score: 7", models=("other-judge",))
    script_args = preset_arguments("--judge_base_url", stub.base_url)
    with pytest.raises(ValueError, match=r"does not serve the model .*SmolLM2.*'other-judge'"):
        load_rewards(script_args)


def test_a_judge_without_its_server_or_with_a_bad_extra_body_is_refused():
    script_args = make_parser().parse_args_and_config(["--reward_funcs", "judge"])[0]
    with pytest.raises(ValueError, match="judge_base_url, judge_model, judge_rubric"):
        load_rewards(script_args)
    script_args = preset_arguments("--judge_extra_body", "[1]")
    with pytest.raises(ValueError, match="judge_extra_body must be a JSON object"):
        load_rewards(script_args)
