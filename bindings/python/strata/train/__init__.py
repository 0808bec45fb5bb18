"""strata-train: fine-tune a Hugging Face causal LM (a local checkpoint or a Hub ID) on JSON,
JSONL, Parquet or Hub data (plain text, alpaca, chat) with its blocks streamed through Strata,
and export it for AutoModelForCausalLM.from_pretrained. The command line:

    strata-train --model Qwen/Qwen3-0.6B --data chat.jsonl --max-steps 1000 --output out
    python -m strata.train --config train.yaml

and the same from Python: strata.train.main(["--model", ..., ...]) or
strata.train.run(strata.train.config.resolve([...])). docs/train.md lists every option.

Modules: config (the options, the config file), data (datasets, formats, masks, packing, the
resumable batch order), model (checkpoint, tokenizer, st.offload, optimizer, schedule), loop
(the training loop, evaluation, data parallelism), checkpoints (save and resume), export
(sharded safetensors written block by block), metrics (JSONL, TensorBoard, W&B)."""

from .loop import main, run

__all__ = ["main", "run"]
