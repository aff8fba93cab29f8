# A verifiers.v1 environment (verifiers 0.4.0): addition questions, one turn, the last number of the reply scored.
# Run it (docs/environments.md#a-verifiersv1-example):
#   --dataset_name_or_path 'verifiers:docs/examples/add_env.py?num_tasks=64'
#   --environment 'verifiers:docs/examples/add_env.py?num_tasks=64'
import random
import re

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.nodes[trace.calls[-1].node].message.content or ""
        numbers = re.findall(r"-?\d+", reply[-200:])  # the reply's tail only: model text is bounded
        return float(bool(numbers) and numbers[-1] == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.nodes[trace.calls[-1].node].message.content or ""))


class AddTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 64
    seed: int = 0


class AddTaskset(vf.Taskset[AddTask, AddTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        tasks = []
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            data = AddData(prompt=f"What is {a} + {b}? End with the number.", answer=str(a + b))
            tasks.append(AddTask(data, self.config.task))
        return tasks


__all__ = ["AddTaskset"]  # v1's plugin rule: the module exports its Taskset
