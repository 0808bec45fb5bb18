"""strata.torch.StrataTrainer: the Hugging Face Trainer over an offloaded model, data parallel
under torchrun through strata.torch's own data parallelism instead of DDP.

transformers.Trainer trains an offloaded model in one process as it is. Under torchrun its
Accelerator's prepare() wraps the model in torch's DistributedDataParallel (accelerate's
prepare_model, for MULTI_GPU and MULTI_CPU alike), which strata.torch refuses
(strata.torch._foreign): the offloaded model already averages its grads over the ranks, block by
block as each backward pass ends. StrataTrainer is the Trainer with that one wrap left out: the
model is prepared as accelerate prepares one for evaluation (autocast and compilation where
asked, no DDP), which is how the Trainer itself prepares a model that owns its gradient
reduction (one sharded at load time by transformers). Everything else is the Trainer's own: the
distributed sampler (accelerate's prepare of the dataloader gives each rank its batches), the
gradient accumulation (every micro-batch's grads are averaged at once; DDP's no_sync, which
defers that to the last micro-batch, has nothing to defer here), max_grad_norm (accelerate's
clip over model.parameters(): strata.torch's global norm), the schedule and the logging.

Saving: model.state_dict() and the optimizer's state_dict() are collective under data
parallelism, while the Trainer builds them on its writing rank only; StrataTrainer has every
rank join them (_save, _save_optimizer_and_scheduler).

transformers stays an optional dependency: strata.torch imports this module only when
strata.torch.StrataTrainer is first used."""

try:
    import transformers
except ImportError as e:  # transformers (and accelerate, which its Trainer needs) are optional
    raise ImportError("strata.torch.StrataTrainer needs the Hugging Face Trainer: pip install "
                      "transformers accelerate (%s)" % e) from e

import torch

from .optim.base import StrataOptimizer
from .session.session import StrataSession


def _session(model):
    """The model's StrataSession; a model that strata.torch did not offload is refused."""
    session = getattr(model, "strata", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(session, StrataSession):
        raise TypeError("strata.torch.StrataTrainer trains a model offloaded by "
                        "strata.torch.offload (got %s); for any other model use "
                        "transformers.Trainer" % type(model).__name__)
    return session


class StrataTrainer(transformers.Trainer):
    """transformers.Trainer for a model offloaded by strata.torch.offload, data parallel under
    torchrun through the offloaded model's own data parallelism (no DDP). Arguments: the
    Trainer's. Give it strata.torch's optimizer: optimizers=(strata.torch.AdamW(...), None),
    or optimizer_cls_and_kwargs=(strata.torch.AdamW, {...}) (the Trainer's parameter groups).

    Under torchrun, offload the model after the process group exists: after
    TrainingArguments(...) (which initializes it) or torch.distributed.init_process_group()."""

    def __init__(self, model=None, *args, **kwargs):
        session = _session(model)
        super().__init__(model, *args, **kwargs)
        processes = self.accelerator.num_processes
        ranks = 1 if session.mesh is None else session.mesh.world
        if ranks != processes:
            raise RuntimeError(
                "strata.torch.StrataTrainer: the Trainer runs %d processes, each on its own "
                "share of the batches, but the offloaded model averages its grads over %d "
                "rank(s)%s. Offload the model after the process group exists (after "
                "TrainingArguments(...), which initializes it under torchrun, or after "
                "torch.distributed.init_process_group()), with data_parallel= left out or "
                "over the default group" % (
                    processes, ranks, " (it was offloaded before torch.distributed was "
                    "initialized, or with data_parallel=False)" if session.mesh is None else ""))
        self._strata_data_parallel = session.mesh is not None

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        prepare_model = self.accelerator.prepare_model

        def without_ddp(model, device_placement=None, evaluation_mode=False):
            # Offloaded models only (the Trainer passes self.model): evaluation_mode leaves out
            # the DDP (and FSDP) wrap and nothing else that training needs.
            offloaded = getattr(model, "strata", None) is not None
            return prepare_model(model, device_placement=device_placement,
                                 evaluation_mode=evaluation_mode or offloaded)

        self.accelerator.prepare_model = without_ddp

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if not isinstance(optimizer, StrataOptimizer):
            # Given (optimizers=) or the Trainer's default (torch.optim.AdamW): refused here,
            # before a forward pass would refuse it less plainly.
            raise TypeError(
                "strata.torch.StrataTrainer: the optimizer is %s, which cannot update the "
                "streamed parameters; give the Trainer strata.torch's: optimizers="
                "(strata.torch.AdamW(model.parameters(), lr=..., weight_decay=...), None), or "
                "optimizer_cls_and_kwargs=(strata.torch.AdamW, {...}) for the Trainer's own "
                "parameter groups (no weight decay on biases and norms)" % (
                    type(optimizer).__module__ + "." + type(optimizer).__qualname__))
        return optimizer

    def _save(self, output_dir=None, state_dict=None):
        if self._strata_data_parallel and state_dict is None:
            # Collective: every rank gathers the streamed weights, the writer saves them.
            state_dict = self.model.state_dict()
            if not self.args.should_save:
                return
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir):
        if self._strata_data_parallel and not self.args.should_save:
            # The writer's optimizer.state_dict() (in the Trainer's method) is collective: the
            # other ranks join it here.
            self.optimizer.state_dict()
        super()._save_optimizer_and_scheduler(output_dir)
