"""strata-train's metrics: one JSON object a line in <output>/metrics.jsonl (appended to on
resume), and TensorBoard or Weights & Biases when --report-to names them (imported only
then). Only the writing process (rank 0) makes one."""

import json
import os

from .config import UsageError


class Metrics:
    def __init__(self, output, report_to=(), options=None):
        os.makedirs(output, exist_ok=True)
        self.path = os.path.join(output, "metrics.jsonl")
        self._file = open(self.path, "a")
        self._tensorboard = self._wandb = None
        report_to = report_to or ()
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError("--report-to tensorboard needs the tensorboard package "
                                 "(pip install tensorboard)") from None
            self._tensorboard = SummaryWriter(os.path.join(output, "tensorboard"))
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                raise UsageError("--report-to wandb needs the wandb package (pip install "
                                 "wandb)") from None
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "strata-train"),
                                     config=options, dir=output)

    def write(self, step, **values):
        record = {"step": step}
        record.update(values)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        if self._tensorboard is not None:
            for k, v in numbers.items():
                self._tensorboard.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self):
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read(path):
    """The records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
