"""strata-train's model: a local checkpoint directory or a Hub ID (huggingface_hub's
snapshot_download: the config, safetensors and tokenizer files), built on the meta device and
offloaded with its safetensors streamed straight into Strata's tiers (st.offload(weights=)),
never a whole copy in host memory; a directory with a config and no weights starts from the
model's own initialization under --seed. Then the optimizer (strata.torch's) and the
schedule (transformers' get_scheduler)."""

import glob
import os

import torch

from .config import UsageError

HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def resolve(spec, what="--model"):
    """A local directory for `spec`: itself, or the Hub snapshot of that ID (downloaded where
    the network allows, else taken from the local cache)."""
    if os.path.isdir(spec):
        return spec
    if os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UsageError("%s %s: no such directory (a local checkpoint directory or a Hub ID "
                         "such as Qwen/Qwen3-0.6B)" % (what, spec))
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(spec, allow_patterns=HUB_FILES)
    except Exception as e:
        raise UsageError("%s %s: not a local directory, and the Hub could not give it (%s: %s)"
                         % (what, spec, type(e).__name__, e)) from None


def weights_of(directory):
    """The safetensors checkpoint of `directory` (st.offload's weights=), or None."""
    if os.path.exists(os.path.join(directory, "model.safetensors")) or \
            os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        return directory
    if glob.glob(os.path.join(directory, "*.bin")):
        raise UsageError("--model %s has PyTorch .bin weights only; strata-train streams "
                         "safetensors (convert them: AutoModelForCausalLM.from_pretrained(dir)"
                         ".save_pretrained(out))" % directory)
    return None


def load_tokenizer(spec):
    from transformers import AutoTokenizer
    directory = resolve(spec, "--tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as e:
        raise UsageError("--tokenizer %s: cannot be loaded (%s: %s)"
                         % (spec, type(e).__name__, e)) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dtype_of(options, device):
    if options.dtype:
        return getattr(torch, options.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_config(options, directory):
    """The checkpoint's config, refused where AutoModelForCausalLM has no class for it
    (refuse_non_causal)."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(directory)
    except Exception as e:
        raise UsageError("--model %s: no usable config.json (%s: %s)"
                         % (options.model, type(e).__name__, e)) from None
    refuse_non_causal(options, config)
    return config


def build(options, directory, config, device, data_parallel):
    """The offloaded model (fp32 masters, the compute dtype on the device) of `config`
    (load_config's)."""
    import strata.torch as st
    from strata.torch._weights import WeightsError
    from transformers import AutoModelForCausalLM
    weights = weights_of(directory)
    torch.manual_seed(options.seed)
    if weights is not None and data_parallel:
        # st.offload(weights=) is not there yet under data parallelism: each rank reads the
        # checkpoint through transformers (a host copy of the model per rank, once).
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        weights = None
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gib = 1 << 30
    try:
        model = st.offload(
            model, device=device, dtype=dtype_of(options, device), weights=weights,
            gpu_budget=int(options.gpu_budget * gib) if options.gpu_budget else None,
            host_budget=int(options.host_budget * gib) if options.host_budget else None,
            nvme=options.nvme)
    except WeightsError as e:  # a checkpoint that does not fit the model: named, no traceback
        raise UsageError("--model %s: %s" % (options.model, e)) from None
    return model


def refuse_non_causal(options, config):
    """A checkpoint AutoModelForCausalLM does not build (most vision-language models: their
    classes are image-text-to-text ones) is refused by name before anything loads."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    raise UsageError(
        "--model %s: a %s model, which transformers' AutoModelForCausalLM does not build "
        "(architectures: %s); strata-train trains causal LMs on text. A vision-language model "
        "trains through strata.torch in Python (docs/python-guide.md, \"Vision-language "
        "models\")" % (options.model, config.model_type,
                        ", ".join(getattr(config, "architectures", None) or ["?"])))


def optimizer(options, model):
    import strata.torch as st
    kinds = {"adamw": st.AdamW, "adam": st.Adam, "sgd": st.SGD, "lion": st.Lion,
             "adagrad": st.Adagrad}
    kwargs = {"lr": options.lr, "weight_decay": options.weight_decay}
    if options.betas is not None:
        if options.optimizer not in ("adamw", "adam", "lion"):
            raise UsageError("--betas is for adamw, adam and lion, not %s" % options.optimizer)
        kwargs["betas"] = tuple(options.betas)
    if options.eps is not None:
        if options.optimizer not in ("adamw", "adam", "adagrad"):
            raise UsageError("--eps is for adamw, adam and adagrad, not %s" % options.optimizer)
        kwargs["eps"] = options.eps
    if options.momentum is not None:
        if options.optimizer != "sgd":
            raise UsageError("--momentum is for sgd, not %s" % options.optimizer)
        kwargs["momentum"] = options.momentum
    return kinds[options.optimizer](model.parameters(), **kwargs)


def scheduler(options, opt, steps):
    from transformers import get_scheduler
    warmup = options.warmup_steps or int(options.warmup_ratio * steps)
    try:
        return get_scheduler(options.scheduler, opt, num_warmup_steps=warmup,
                             num_training_steps=steps)
    except ValueError as e:
        raise UsageError("--scheduler %s: %s" % (options.scheduler, e)) from None
