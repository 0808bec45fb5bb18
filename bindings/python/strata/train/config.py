"""strata-train's options: one table (OPTIONS) from which the command line, the config file's
keys and their checks all come. A config file (YAML or JSON) holds the same keys as the flags,
with underscores (`micro_batch: 4` for `--micro-batch 4`); a flag given on the command line
overrides the file, which overrides the defaults."""

import argparse
import dataclasses
import difflib
import json
import os
import pathlib

DEFAULT_DIR = pathlib.Path(__file__).resolve().parent / "default"


class UsageError(ValueError):
    """A bad option, file or dataset: the message names it; the command prints it and exits 2."""


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    type: object
    default: object
    help: str
    choices: tuple = None
    many: bool = False  # a list: the flag repeats, the file gives a list


OPTIONS = [
    # What to train.
    Option("model", str, str(DEFAULT_DIR),
           "a Hugging Face checkpoint directory (config.json, safetensors weights, tokenizer) or "
           "a Hub ID; default: the embedded small Llama-style model"),
    Option("tokenizer", str, None, "a tokenizer directory or Hub ID (default: --model's)"),
    Option("data", str, [str(DEFAULT_DIR / "chat.jsonl")],
           "JSON/JSONL/Parquet/text files (repeatable) or a `datasets` Hub name; default: the "
           "bundled chat dataset", many=True),
    Option("data_split", str, "train", "the split of a Hub dataset"),
    Option("format", str, "auto", "how the rows read: auto (from the columns), text (packed "
           "plain text), alpaca (instruction/input/output) or chat (messages or conversations)",
           choices=("auto", "text", "alpaca", "chat")),
    Option("train_on_prompt", bool, False,
           "compute the loss on the prompt tokens too (default: completion tokens only)"),
    Option("seq_len", int, 256, "tokens per row (longer examples are truncated)"),
    Option("packing", bool, False, "pack examples into rows of --seq-len tokens (plain text "
           "always is)"),
    Option("eval_split", float, 0.0, "the fraction of the data held out for evaluation"),
    Option("eval_data", str, None, "evaluation files or Hub name (instead of --eval-split)",
           many=True),
    Option("eval_every", int, 0, "evaluate every N steps (0: only at the end, when there is "
           "evaluation data)"),
    # How to train.
    Option("micro_batch", int, 8, "rows per forward pass (per process under torchrun)"),
    Option("accumulation", int, 1, "micro-batches per optimizer step"),
    Option("max_steps", int, 0, "optimizer steps (0: --epochs over the data)"),
    Option("epochs", float, 1.0, "passes over the data when --max-steps is 0"),
    Option("stop_after", int, 0, "stop after this many steps of this run (0: at the end); the "
           "schedule still spans every step: a job split into slots, each resuming the last"),
    Option("optimizer", str, "adamw", "strata.torch's optimizer",
           choices=("adamw", "adam", "sgd", "lion", "adagrad")),
    Option("lr", float, 5e-5, "peak learning rate (the Trainer's default)"),
    Option("weight_decay", float, 0.0, "weight decay"),
    Option("betas", float, None, "AdamW/Adam/Lion betas (two values)", many=True),
    Option("eps", float, None, "AdamW/Adam/Adagrad eps"),
    Option("momentum", float, None, "SGD momentum"),
    Option("scheduler", str, "linear", "a transformers.get_scheduler name (linear, cosine, "
           "constant_with_warmup, ...)"),
    Option("warmup_steps", int, 0, "linear warm-up steps"),
    Option("warmup_ratio", float, 0.0, "warm-up as a fraction of the steps (when "
           "--warmup-steps is 0)"),
    Option("clip", float, 1.0, "clip the gradients' global norm to this (0: no clipping)"),
    Option("seed", int, 0, "the seed of the weights' initialization, the data order and the "
           "split"),
    # Where.
    Option("device", str, None, "cuda or cpu (default: cuda when there is one)"),
    Option("dtype", str, None, "compute dtype (default: bfloat16 on a GPU, float32 on the CPU)",
           choices=("float32", "bfloat16", "float16")),
    Option("threads", int, 0, "torch's CPU threads (0: torch's default; 1 is fastest for tiny "
           "models on the CPU, where threads only wait on each other)"),
    Option("gpu_budget", float, None, "GiB of GPU memory for Strata"),
    Option("host_budget", float, None, "GiB of host memory for Strata"),
    Option("nvme", str, None, "NVMe tier files (repeatable): state host memory cannot hold",
           many=True),
    # Output.
    Option("output", str, "strata-train-out", "the output directory: metrics.jsonl, "
           "checkpoints/, the exported model in model/"),
    Option("save_every", int, 0, "write a checkpoint every N steps (0: never)"),
    Option("resume", str, None, "a checkpoint directory to continue from, or `latest` (the "
           "newest under --output)"),
    Option("export", bool, True, "export the trained model for from_pretrained at the end"),
    Option("export_shard_size", str, "2GB", "the largest safetensors shard of the export"),
    Option("verify_export", bool, False, "reload the export with from_pretrained and compare "
           "its logits with Strata's (loads the whole model in host memory)"),
    Option("report_to", str, None, "tensorboard and/or wandb (repeatable)", many=True,
           choices=("tensorboard", "wandb")),
    Option("log_every", int, 1, "write metrics every N steps"),
    Option("config", str, None, "a YAML or JSON file of these options (flags override it)"),
]
BY_NAME = {o.name: o for o in OPTIONS}


def flag(name):
    return "--" + name.replace("_", "-")


def parser():
    p = argparse.ArgumentParser(
        prog="strata-train",
        description="Fine-tune a Hugging Face causal LM with its blocks streamed through "
                    "Strata, and export it for from_pretrained.",
        argument_default=argparse.SUPPRESS)  # only what was given: it overrides the file
    for o in OPTIONS:
        kwargs = {"help": o.help + ("" if o.default is None else " (default: %s)" % (o.default,))}
        if o.type is bool:
            p.add_argument(flag(o.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if o.choices and o.type is str and not o.many:
            kwargs["choices"] = o.choices
        if o.many:
            kwargs["nargs"] = "+"
            kwargs["action"] = "extend"
        p.add_argument(flag(o.name), type=o.type, **kwargs)
    return p


def read_file(path):
    """The options of a YAML or JSON config file, as a dict."""
    if not os.path.exists(path):
        raise UsageError("--config %s: no such file" % path)
    text = pathlib.Path(path).read_text()
    try:
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml  # pyproject's [train] extra
            values = yaml.safe_load(text)
    except ImportError:
        raise UsageError("--config %s: reading YAML needs pyyaml (pip install pyyaml, or "
                         "strata-tiering[train]); or give a .json file" % path) from None
    except Exception as e:
        raise UsageError("--config %s: not valid %s: %s"
                         % (path, "JSON" if path.endswith(".json") else "YAML", e)) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UsageError("--config %s: expected a mapping of option: value, got a %s"
                         % (path, type(values).__name__))
    return values


def _coerce(option, value, where):
    """`value` from a config file as the option's type, or a UsageError naming it."""
    if value is None:
        return None
    if option.many:
        values = value if isinstance(value, list) else [value]
        return [_coerce(dataclasses.replace(option, many=False), v, where) for v in values]
    if option.type is bool:
        if not isinstance(value, bool):
            raise UsageError("%s: %s must be true or false, not %r" % (where, option.name, value))
        return value
    try:
        if option.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        out = option.type(value)
    except (TypeError, ValueError):
        kind = {"int": "an integer", "float": "a number", "str": "a string"}.get(
            option.type.__name__, "a " + option.type.__name__)
        raise UsageError("%s: %s must be %s, not %r" % (where, option.name, kind, value)) from None
    return out


def _check_choices(option, value, where):
    for v in value if option.many and value is not None else [value]:
        if option.choices and v is not None and v not in option.choices:
            raise UsageError("%s: %s is %r; one of %s"
                             % (where, option.name, v, ", ".join(option.choices)))


def resolve(argv=None):
    """The options: defaults, then the config file's, then the flags given. A namespace with
    every option as an attribute."""
    given = vars(parser().parse_args(argv))
    values = {o.name: o.default for o in OPTIONS}
    config = given.get("config")
    if config:
        for key, value in read_file(config).items():
            name = str(key).replace("-", "_")
            if name not in BY_NAME or name == "config":
                near = difflib.get_close_matches(name, list(BY_NAME), n=1)
                raise UsageError("--config %s: unknown option %r%s" % (
                    config, key, "; did you mean %r?" % near[0] if near else ""))
            values[name] = _coerce(BY_NAME[name], value, "--config " + config)
    values.update(given)
    for o in OPTIONS:
        _check_choices(o, values[o.name], "strata-train")
    return argparse.Namespace(**values)


def check(options):
    """Cross-option rules, refused with the option's name."""
    positive = ("seq_len", "micro_batch", "accumulation", "log_every")
    for name in positive:
        if getattr(options, name) < 1:
            raise UsageError("%s must be at least 1, not %s" % (flag(name), getattr(options, name)))
    for name in ("max_steps", "eval_every", "save_every", "warmup_steps", "stop_after",
                 "threads"):
        if getattr(options, name) < 0:
            raise UsageError("%s must not be negative" % flag(name))
    if not 0.0 <= options.eval_split < 1.0:
        raise UsageError("--eval-split must be in [0, 1), not %s" % options.eval_split)
    if options.eval_split and options.eval_data:
        raise UsageError("--eval-split and --eval-data both given: choose one")
    if options.max_steps == 0 and options.epochs <= 0:
        raise UsageError("--epochs must be positive when --max-steps is 0")
    if options.betas is not None and len(options.betas) != 2:
        raise UsageError("--betas takes two values, got %d" % len(options.betas))


def to_dict(options):
    """The options as a config file would hold them (what the output's train_config.json is)."""
    return {o.name: getattr(options, o.name) for o in OPTIONS if o.name != "config"}
