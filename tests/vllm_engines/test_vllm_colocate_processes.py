"""A colocated engine in each of two training processes (`accelerate launch`, gloo on CPU): each
process builds its own engine with vLLM's `external_launcher` backend, as TRL does, and trains."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm_helpers import share_precompiled_headers  # noqa: E402

pytestmark = pytest.mark.vllm

SCRIPT = os.path.join(os.path.dirname(__file__), "colocate_two_processes.py")


def test_two_processes_each_train_with_their_own_colocated_engine(vllm_model_dir, tmp_path):
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    # --multi_gpu on a machine without GPUs: two gloo processes on the CPU (`--cpu` starts one)
    command = [
        accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--mixed_precision", "no",
        "--main_process_port", "0", SCRIPT, str(vllm_model_dir), str(tmp_path / "runs"),
    ]  # fmt: skip
    private_tmpdir = tmp_path / "tmpdir"
    private_tmpdir.mkdir()
    share_precompiled_headers(private_tmpdir)
    env = dict(os.environ, TMPDIR=str(private_tmpdir))
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    assert process.returncode == 0, output[-3000:]
    for rank in (0, 1):
        expected = f"process {rank}: backend external_launcher, adapter adapter-v1, steps 2"
        assert expected in output, output[-3000:]
    # each process removed its adapter versions (torch's launcher and compiler caches stay)
    ours = [name for name in os.listdir(private_tmpdir) if name.startswith("trl_grpo_ext-")]
    assert ours == [], os.listdir(private_tmpdir)
