"""Run by test_vllm_colocate_processes.py under `accelerate launch --num_processes 2`: each
training process trains two steps with its own colocated vLLM engine and reports it."""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(model_dir: str, output_dir: str) -> None:
    from trainer_helpers import make_trainer, odd_first_byte
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = make_trainer(
        os.path.join(output_dir, f"process-{os.environ['RANK']}"),
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        max_steps=2,
        reward_funcs=odd_first_byte,
    )
    trainer.train()
    engine = trainer.rollouts.engine
    backend = engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    print(
        f"process {trainer.args.process_index}: backend {backend}, adapter "
        f"{engine.adapter.lora_name}, steps {trainer.state.global_step}",
        flush=True,
    )
    trainer.rollouts.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
