"""One cell of the settings matrix (test_settings_matrix.py), run as a script in a process of its
own so that a hang can be killed and the process's leftovers (temporary files, processes) seen:

    python matrix_cell.py SETTINGS_JSON RESULT_JSON

SETTINGS_JSON holds `model_dir`, `output_dir`, `engine` ("colocate" or "server"), `base_url`,
`max_staleness`, `lora_r`, `evaluate` (a periodic `trainer.evaluate()`), `max_steps`,
`save_steps` (0: no checkpoints), `dump_stacks_after` (seconds) and `phase`: "run" (from scratch to the end), "stop" (stop after
the checkpoint of step `save_steps`) or "resume" (from the last checkpoint to the end).
RESULT_JSON gets the trainer's log history, its last step, the adapter versions the engine was
given, in order, and the engine calls that overlapped unsafely (`EngineRecorder`).
"""

import faulthandler
import functools
import json
import sys
import threading
from pathlib import Path

# Before the harness kills a hung cell: every thread's stack, to show where it hung (timed from
# here, before the slow imports).
faulthandler.dump_traceback_later(
    json.loads(Path(sys.argv[1]).read_text())["dump_stacks_after"], exit=False
)

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # trainer_helpers, as pytest's pythonpath does

from trainer_helpers import digit_sums, lora_config, odd_first_byte  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer  # noqa: E402


class StopAfterSave(TrainerCallback):
    """Stops training after the checkpoint of step `step`, as a run that is stopped mid-way."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class EngineRecorder:
    """Records, for both vLLM engines, the version of every adapter published, in order, and
    every call that overlapped another on the same engine where that is unsafe: any two on the
    colocated engine (a `vllm.LLM` is not thread-safe), and a publication with anything on the
    server (it unloads the adapter that a request in flight may be using)."""

    def __init__(self):
        from trl_grpo_ext.generation.vllm_colocate import VLLMColocateEngine
        from trl_grpo_ext.generation.vllm_server import VLLMServerEngine

        self.published: list[int] = []
        self.overlaps: list[str] = []
        self._lock = threading.Lock()
        self._active: dict[int, list[tuple[str, str]]] = {}  # id(engine) -> (call, thread)
        for engine_class in (VLLMColocateEngine, VLLMServerEngine):
            for name in ("generate", "publish_adapter"):
                setattr(engine_class, name, self._watched(getattr(engine_class, name), name))
        self._colocated = VLLMColocateEngine

    def _watched(self, method, name):
        @functools.wraps(method)
        def watched(engine, *args, **kwargs):
            call = (name, threading.current_thread().name)
            with self._lock:
                active = self._active.setdefault(id(engine), [])
                unsafe = isinstance(engine, self._colocated) or any(
                    "publish_adapter" in (name, other) for other, _ in active
                )
                if active and unsafe:
                    self.overlaps.append(f"{call} while {active} ran")
                active.append(call)
            try:
                result = method(engine, *args, **kwargs)
            finally:
                with self._lock:
                    active.remove(call)
            if name == "publish_adapter":
                self.published.append(args[1] if len(args) > 1 else kwargs["version"])
            return result

        return watched


def main(settings_path: str, result_path: str) -> None:
    cell = json.loads(Path(settings_path).read_text())
    engines = EngineRecorder()
    config = dict(
        output_dir=cell["output_dir"],
        use_vllm=True,
        vllm_mode=cell["engine"],
        vllm_server_base_url=cell.get("base_url"),
        vllm_max_model_length=128,
        max_staleness=cell["max_staleness"],
        max_steps=cell["max_steps"],
        num_generations=4,
        max_completion_length=2,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        save_strategy="no",
    )
    if cell["evaluate"]:
        config.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    if cell["save_steps"]:
        config.update(save_strategy="steps", save_steps=cell["save_steps"])
    trainer = GroupRelativeTrainer(
        model=AutoModelForCausalLM.from_pretrained(cell["model_dir"]),
        reward_funcs=odd_first_byte,
        args=GroupRelativeConfig(**config),
        train_dataset=digit_sums(),
        eval_dataset=digit_sums(2) if cell["evaluate"] else None,  # 4 prompts
        processing_class=AutoTokenizer.from_pretrained(cell["model_dir"]),
        peft_config=lora_config(r=cell["lora_r"]),
    )
    if cell["phase"] == "stop":
        trainer.add_callback(StopAfterSave(cell["save_steps"]))
    trainer.train(resume_from_checkpoint=True if cell["phase"] == "resume" else None)
    result = dict(
        global_step=trainer.state.global_step,
        published=engines.published,
        overlaps=engines.overlaps,
        log_history=trainer.state.log_history,
    )
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
