"""A stand-in for MegaTrain's `infinity` package as bench/megatrain_peer.py drives it (MegaTrain
itself needs CUDA and is kept out of the repository): its configuration class, CPUMasterConfig,
with the fields the peer sets and MegaTrain's defaults, is here once; each test gives the
CPUMasterModel it needs (test_train_bench.py: one process; test_dist_bench.py: the
data-parallel mode's shared grads)."""
import textwrap

_CONFIG = '''
import dataclasses
import torch

FLASH_CE_AVAILABLE = False


@dataclasses.dataclass
class CPUMasterConfig:
    model_name: str = ""
    dataset_path: str = ""
    batch_size: int = 1
    max_seq_len: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-5
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    attn_implementation: str = "flash_attention_2"
    trust_remote_code: bool = True
    dtype: object = None
    device: int = 0
    devices: list = dataclasses.field(default_factory=list)  # the data-parallel mode's GPUs
    checkpoint_interval: int = 4
    num_grad_slabs: int = 12
    seed: int = 42
    log_interval: int = 1
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
'''


# A CPUMasterModel whose training is the Hugging Face model's own on the CPU (forward_and_backward
# / get_parameters / _sync_params_to_gpu / zero_grad / cleanup, the sdpa mask patch's
# _layer_attention_mask): what a bench reports of the peer must then be that model's training
# (test_train_bench.py, test_moe_bench.py).
PLAIN_TRAINING = """
        class CPUMasterModel:
            def __init__(self, hf_model, config):
                assert config.attn_implementation == "sdpa"
                self.hf, self.config = hf_model, config

            @staticmethod
            def _layer_attention_mask(mask, attn_implementation, dtype):
                return None

            def forward_and_backward(self, input_ids, attention_mask, labels):
                assert bool(attention_mask.all()) and input_ids.shape == (
                    self.config.batch_size, self.config.max_seq_len)
                loss = self.hf(input_ids, labels=labels).loss
                loss.backward()
                return loss.item(), input_ids.numel(), {"forward": 0.5, "backward": 1.5,
                                                        "total": 2.0}

            def get_parameters(self):
                return list(self.hf.parameters())

            def _sync_params_to_gpu(self):
                pass

            def zero_grad(self):
                for p in self.hf.parameters():
                    if p.grad is not None:
                        p.grad.zero_()

            def cleanup(self):
                pass
        """


def write(root, model):
    """The package under `root` (a pathlib.Path: root/infinity/...), its CPUMasterModel
    `model` (a class's source, at any indentation: dedented)."""
    files = {
        "infinity/__init__.py": "from .model.cpu_master import CPUMasterModel, CPUMasterConfig\n",
        "infinity/model/__init__.py": "",
        "infinity/model/cpu_master.py": _CONFIG + "\n\n" + textwrap.dedent(model),
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
