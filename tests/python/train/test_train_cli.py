"""strata-train (issue 52, items 1 and 2) on the CPU, on tiny models and the bundled data:

- the main job (scripts/demo.sh's command, `python -m strata.train --config
  examples/train/default.yaml`, shortened) fine-tunes the embedded model on the bundled chat
  data, exports it, and the export reloaded with from_pretrained gives Strata's logits and
  holds the last checkpoint's weights;
- one strata-train run equals plain PyTorch (transformers' model, torch.optim.AdamW,
  get_scheduler, clip_grad_norm_) on the same rows: the framework is the oracle;
- the loss is on the completion tokens only, checked by hand on the embedded chat template,
  and the two ways of finding them (the template's {% generation %} marks, the prefix
  renderings) agree;
- --stop-after then --resume continues bit for bit (losses and exported weights equal);
- the config file's keys and the flags (flags win), and bad input refused with its name."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("yaml")

from strata.train import config, data, loop  # noqa: E402
from strata.train.metrics import read as read_metrics  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEFAULT = config.DEFAULT_DIR
FAST = ["--threads", "1", "--seq-len", "64", "--device", "cpu"]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny Llama (the embedded config, 2 layers, random weights) with the embedded
    tokenizer: a local Hugging Face checkpoint directory."""
    path = tmp_path_factory.mktemp("ckpt")
    cfg = transformers.AutoConfig.from_pretrained(str(DEFAULT))
    cfg.num_hidden_layers = 2
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    transformers.AutoTokenizer.from_pretrained(str(DEFAULT)).save_pretrained(str(path))
    return path


def run(argv):
    """strata-train in this process; its exit status."""
    return loop.main(list(map(str, argv)))


def losses(output):
    return [r["loss"] for r in read_metrics(os.path.join(output, "metrics.jsonl"))
            if "loss" in r]


def exported(output):
    from safetensors.torch import load_file
    return load_file(os.path.join(output, "model", "model.safetensors"))


def test_main_job_trains_exports_and_reloads(tmp_path, one_torch_thread):
    """The README's main job, scripts/demo.sh's command (its config, in this process), for 4
    steps."""
    out = tmp_path / "out"
    assert run(["--config", ROOT / "examples/train/default.yaml", "--max-steps", 4,
                "--save-every", 4, "--eval-every", 2, "--output", out, "--device", "cpu"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    # The command's own check: the reloaded export's logits equal Strata's.
    assert [r["export_max_logit_diff"] for r in records
            if "export_max_logit_diff" in r] == [0.0]
    # And here, independently: from_pretrained loads it, and its weights are the last
    # checkpoint's (Strata's streamed blocks as the checkpoint holds them).
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model"))
    from safetensors.torch import load_file
    streamed = load_file(str(out / "checkpoints/step-00000004/state/streamed/model.safetensors"))
    state = model.state_dict()
    assert streamed and all(torch.equal(state[name], value) for name, value in streamed.items())
    tok = transformers.AutoTokenizer.from_pretrained(str(out / "model"))
    assert tok.chat_template and tok.eos_token == "<|end|>"


def test_the_module_and_its_help():
    """`python -m strata.train` is the command (the console script strata-train calls the same
    main)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "bindings" / "python"))
    done = subprocess.run([sys.executable, "-m", "strata.train", "--help"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--micro-batch" in done.stdout and "--resume" in done.stdout


def test_one_run_equals_plain_pytorch(tmp_path, checkpoint, one_torch_thread):
    """3 steps of 2 micro-batches, clipping, AdamW with weight decay, a warm-up cosine: the
    losses and the exported weights equal transformers + torch.optim.AdamW on the same rows."""
    argv = ["--model", checkpoint, "--max-steps", 3, "--micro-batch", 4, "--accumulation", 2,
            "--lr", 2e-3, "--weight-decay", 0.1, "--warmup-steps", 1, "--clip", 0.5,
            "--output", tmp_path / "out", "--seed", 3] + FAST
    assert run(argv) == 0
    options = config.resolve(list(map(str, argv)))
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    rows, _, _ = loop.prepare_data(options, tok, 1)
    batches = data.Batches(rows, 4, 3, pad_id=tok.pad_token_id)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint),
                                                              dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=3)
    expected = []
    for _ in range(3):
        micro = [batches.next() for _ in range(2)]
        count = sum(loop.label_count(b) for b in micro)
        total = 0.0
        for b in micro:
            loss = model(**b, num_items_in_batch=count).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        expected.append(total)
    got = losses(tmp_path / "out")
    assert len(got) == 3
    for g, e in zip(got, expected):
        assert abs(g - e) <= 1e-6 * abs(e), (got, expected)
    weights = exported(tmp_path / "out")
    reference = model.state_dict()
    assert set(weights) == set(reference)
    for name, value in weights.items():
        assert torch.allclose(value, reference[name], atol=1e-6, rtol=1e-6), name


def test_stop_and_resume_is_bit_for_bit(tmp_path, checkpoint, one_torch_thread, capsys):
    """4 steps at once against 2 steps (--stop-after 2, a checkpoint), then --resume latest for
    the rest: the same losses and the same exported weights, to the bit (the data's position,
    the schedule and the RNG come back with the checkpoint)."""
    common = ["--model", checkpoint, "--max-steps", 4, "--micro-batch", 4, "--lr", 2e-3,
              "--warmup-steps", 1, "--eval-split", 0.1] + FAST
    assert run(common + ["--output", tmp_path / "whole"]) == 0
    split = tmp_path / "split"
    assert run(common + ["--output", split, "--save-every", 2, "--stop-after", 2]) == 0
    assert not (split / "model").exists()  # stopped early: nothing exported yet
    said = capsys.readouterr().err
    assert "stopped at step 2 of 4 (--stop-after 2), nothing exported" in said
    assert "continue with --resume latest" in said and "no checkpoint" not in said
    assert run(common + ["--output", split, "--save-every", 2, "--resume", "latest"]) == 0
    assert losses(split) == losses(tmp_path / "whole")
    a, b = exported(tmp_path / "whole"), exported(split)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_other_data_settings(tmp_path, checkpoint, one_torch_thread):
    common = ["--model", checkpoint, "--max-steps", 2, "--micro-batch", 4, "--output",
              tmp_path] + FAST
    assert run(common + ["--save-every", 1, "--stop-after", 1]) == 0
    with pytest.raises(config.UsageError, match="--micro-batch 4, this run has 2"):
        loop.run(config.resolve(list(map(str, common[:5] + ["2"] + common[6:] +
                                          ["--resume", "latest"]))))


def conversation():
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5."},
            {"role": "user", "content": "Spell 'river' backwards."},
            {"role": "assistant", "content": "'river' backwards is 'revir'."}]


def test_loss_only_on_the_assistant_turns(tokenizer):
    """Checked by hand against the embedded template: each turn is "<|role|>\\n{content}<|end|>",
    and exactly the assistant contents with their <|end|> are trained."""
    row = data.Encoder(tokenizer, "chat")({"messages": conversation()})
    text = tokenizer.decode(row["input_ids"])
    assert text == ("<|bos|><|system|>\nAnswer briefly.<|end|><|user|>\nWhat is 2 + 3?<|end|>"
                    "<|assistant|>\n2 + 3 = 5.<|end|><|user|>\nSpell 'river' backwards.<|end|>"
                    "<|assistant|>\n'river' backwards is 'revir'.<|end|>")
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != data.IGNORE]
    assert [t for t in row["labels"] if t != data.IGNORE] == trained
    # The trained tokens are the two answers, each closed by <|end|>, and nothing else.
    spans, current = [], []
    for t, label in zip(row["input_ids"], row["labels"]):
        if label != data.IGNORE:
            current.append(t)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans.append(tokenizer.decode(current))
    assert spans == ["2 + 3 = 5.<|end|>", "'river' backwards is 'revir'.<|end|>"]
    # --train-on-prompt trains every token.
    everything = data.Encoder(tokenizer, "chat", train_on_prompt=True)({"messages": conversation()})
    assert everything["labels"] == everything["input_ids"]


def test_the_prefix_rendering_finds_the_same_tokens(tokenizer):
    """A template without {% generation %} (the embedded one with the marks taken out) gives
    the same ids and the same completion tokens through the prefix renderings."""
    marked = data.chat_completion_mask(tokenizer, conversation())
    plain = transformers.AutoTokenizer.from_pretrained(str(DEFAULT))
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    assert not data.GENERATION_MARK.search(plain.chat_template)
    assert data.GENERATION_MARK.search(tokenizer.chat_template)
    assert data.chat_completion_mask(plain, conversation()) == marked
    assert any(marked[1]) and not all(marked[1])


def test_sharegpt_and_alpaca_rows(tokenizer):
    sharegpt = {"conversations": [{"from": "human", "value": "What is 2 + 3?"},
                                  {"from": "gpt", "value": "2 + 3 = 5."}]}
    openai = {"messages": conversation()[1:3]}
    assert data.Encoder(tokenizer, "chat")(sharegpt) == data.Encoder(tokenizer, "chat")(openai)
    alpaca = {"instruction": "What is 2 + 3?", "input": "", "output": "2 + 3 = 5."}
    assert data.Encoder(tokenizer, "alpaca")(alpaca) == data.Encoder(tokenizer, "chat")(openai)
    # Without a chat template: Alpaca's own prompt, masked; the answer and EOS trained.
    plain = transformers.AutoTokenizer.from_pretrained(str(DEFAULT))
    plain.chat_template = None
    row = data.Encoder(plain, "alpaca")(alpaca)
    trained = [t for t in row["labels"] if t != data.IGNORE]
    assert plain.decode(trained) == "2 + 3 = 5.<|end|>"
    assert "### Response:" in plain.decode(row["input_ids"])


def test_image_messages_are_refused(tokenizer):
    """transformers' and OpenAI's multimodal messages: a content part that is not text is
    refused by name; a content of text parts only is not."""
    for part in ({"type": "image", "url": "cat.png"}, {"type": "video", "path": "v.mp4"},
                 {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}):
        row = {"messages": [{"role": "user", "content": [part, {"type": "text",
                                                                "text": "What is it?"}]},
                            {"role": "assistant", "content": "A cat."}]}
        with pytest.raises(config.UsageError,
                           match="text only: a user message has a content part of type '%s'"
                                 % part["type"]):
            data.Encoder(tokenizer, "chat")(row)
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]},
                  {"role": "assistant", "content": "2 + 3 = 5."}]
    assert data.messages_of({"messages": text_parts}) == text_parts


def test_a_vision_language_checkpoint_is_refused(tmp_path, capsys, checkpoint):
    """Qwen2.5-VL's config (AutoModelForCausalLM has no class for it): refused by name, before
    any weight loads."""
    vlm = tmp_path / "vlm"
    transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2),
        architectures=["Qwen2_5_VLForConditionalGeneration"]).save_pretrained(str(vlm))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": conversation()}) + "\n")
    argv = ["--model", vlm, "--tokenizer", checkpoint, "--data", chat,
            "--output", tmp_path / "out"] + FAST
    assert run(argv) == 2
    assert "a qwen2_5_vl model, which transformers' AutoModelForCausalLM does not build " \
        "(architectures: Qwen2_5_VLForConditionalGeneration)" in capsys.readouterr().err


def test_text_rows_are_packed(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": "one two three four %d" % i}) + "\n"
                            for i in range(20)))
    rows = data.encode(data.load([str(path)]), tokenizer, "text", 16, False, False)
    lengths = [len(r) for r in rows["input_ids"]]
    assert all(n == 16 for n in lengths[:-1]) and lengths[-1] <= 16
    assert rows["labels"] == rows["input_ids"]


def test_batches_resume_where_they_stopped():
    import datasets
    rows = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(10)],
                                       "labels": [[i, i] for i in range(10)]})
    a = data.Batches(rows, 3, seed=1)
    seen = [a.next()["input_ids"][:, 0].tolist() for _ in range(7)]  # crosses two epochs
    b = data.Batches(rows, 3, seed=1)
    for _ in range(4):
        b.next()
    c = data.Batches(rows, 3, seed=1)
    c.load_state_dict(b.state_dict())
    assert [c.next()["input_ids"][:, 0].tolist() for _ in range(3)] == seen[4:]
    assert sorted(sum(seen[:3], [])) == sorted(set(sum(seen[:3], [])))  # no row twice an epoch
    # Two ranks take the two halves of each global micro-batch of one process.
    one = data.Batches(rows, 4, seed=2)
    ranks = [data.Batches(rows, 2, seed=2, rank=r, world=2) for r in range(2)]
    whole = one.next()["input_ids"][:, 0].tolist()
    assert sum((r.next()["input_ids"][:, 0].tolist() for r in ranks), []) == whole


def test_config_file_and_flags(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("micro_batch: 3\nlr: 1.0e-4\ndata: [a.jsonl, b.jsonl]\npacking: true\n"
                         "seq-len: 32\n")
    o = config.resolve(["--config", str(yaml_file), "--lr", "0.5"])
    assert (o.micro_batch, o.lr, o.data, o.packing, o.seq_len) == \
        (3, 0.5, ["a.jsonl", "b.jsonl"], True, 32)
    assert config.resolve(["--config", str(yaml_file), "--no-packing"]).packing is False
    assert o.accumulation == config.BY_NAME["accumulation"].default
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps({"max_steps": 5, "optimizer": "lion"}))
    o = config.resolve(["--config", str(json_file)])
    assert (o.max_steps, o.optimizer) == (5, "lion")
    for text, message in [("micro_bach: 3\n", "unknown option 'micro_bach'; did you mean "
                                               "'micro_batch'"),
                          ("micro_batch: many\n", "micro_batch must be an integer, not 'many'"),
                          ("optimizer: adamax\n", "optimizer is 'adamax'; one of adamw"),
                          ("packing: 3\n", "packing must be true or false"),
                          ("- 1\n", "expected a mapping")]:
        yaml_file.write_text(text)
        with pytest.raises(config.UsageError, match=message):
            config.resolve(["--config", str(yaml_file)])
    with pytest.raises(config.UsageError, match="no such file"):
        config.resolve(["--config", str(tmp_path / "none.yaml")])


def test_every_option_is_documented():
    docs = (ROOT / "docs" / "train.md").read_text()
    missing = [config.flag(o.name) for o in config.OPTIONS if "`%s" % config.flag(o.name)
               not in docs]
    assert not missing, missing


def test_bad_input_is_named(tmp_path, capsys, checkpoint):
    no_fields = tmp_path / "odd.jsonl"
    no_fields.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": conversation()}) + "\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n" +
                      json.dumps({"instruction": "q", "output": None}) + "\n")
    images = tmp_path / "images.jsonl"
    images.write_text(json.dumps({"messages": conversation(), "images": ["cat.png"]}) + "\n")
    unparsable = tmp_path / "unparsable.jsonl"
    unparsable.write_text(json.dumps({"messages": conversation()}) + "\n{\"messages\": [ oops\n")
    cases = [
        (["--model", checkpoint, "--data", unparsable],
         "unparsable.jsonl: cannot be read: .*JSON parse error"),  # the parser's own words
        (["--model", checkpoint, "--data", images],
         "strata-train trains on text only: --data has the column `images`"),
        (["--data", tmp_path / "missing.jsonl"], "--data: no such file: .*missing.jsonl"),
        (["--data", no_fields], r"cannot tell the format from the columns \['answer', "
                                r"'question'\]"),
        (["--data", chat, "--format", "alpaca"], "--format alpaca needs the columns "
                                                 "`instruction` and `output`"),
        (["--model", checkpoint, "--data", broken], "a row has no `output` \\(the alpaca format "
                                                    "needs it\\)"),
        (["--model", tmp_path / "nowhere"], "--model .*nowhere: no such directory"),
        (["--model", checkpoint, "--data", chat, "--micro-batch", 4],
         "1 training rows are fewer than one micro-batch of 4 rows"),
        (["--eval-split", 1.5], "--eval-split must be in"),
        (["--optimizer", "sgd", "--betas", 0.9, 0.99], "--betas is for adamw"),
        (["--model", checkpoint, "--resume", tmp_path], "not a strata-train checkpoint"),
    ]
    for argv, message in cases:
        assert run(argv + ["--output", tmp_path / "out"] + FAST) == 2, argv
        err = capsys.readouterr().err
        assert "strata-train: error:" in err and __import__("re").search(message, err), \
            (argv, err[-2000:])
    with pytest.raises(SystemExit):  # argparse: an unknown --format names the choices
        config.resolve(["--format", "csvish"])
    assert "invalid choice: 'csvish'" in capsys.readouterr().err


def test_sharded_export_reloads(tmp_path, checkpoint, one_torch_thread):
    """An export cut into shards (the index, every tensor in one shard) reloads with
    from_pretrained and gives Strata's logits."""
    out = tmp_path / "out"
    assert run(["--model", checkpoint, "--max-steps", 1, "--micro-batch", 4, "--output", out,
                "--export-shard-size", "100KB", "--verify-export"] + FAST) == 0
    index = json.loads((out / "model" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == "model-00001-of-%05d.safetensors" % len(shards)
    assert not (out / "model" / "model.safetensors").exists()
    assert not list((out / "model").glob("*.partial"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert set(index["weight_map"]) == set(model.state_dict())
    assert [r["export_max_logit_diff"] for r in read_metrics(out / "metrics.jsonl")
            if "export_max_logit_diff" in r] == [0.0]


def test_an_moe_checkpoint_trains_and_a_broken_one_is_named(tmp_path, capsys, checkpoint,
                                                            one_torch_thread):
    """A tiny Qwen3-MoE saved by save_pretrained (one tensor per expert, as the Hub's MoE
    checkpoints): strata-train streams it in (converted as from_pretrained converts it) and
    trains; with one expert's tensors gone it ends in its error line naming the parameter,
    not a traceback."""
    from safetensors.torch import load_file, save_file
    moe = tmp_path / "moe"
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=640, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(7)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(moe))
    transformers.AutoTokenizer.from_pretrained(str(DEFAULT)).save_pretrained(str(moe))
    argv = ["--model", moe, "--max-steps", 1, "--micro-batch", 2, "--save-every", 0]
    assert run(argv + ["--output", tmp_path / "out"] + FAST) == 0
    assert len(losses(tmp_path / "out")) == 1
    tensors = load_file(str(moe / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".layers.0.mlp.experts.3." not in k},
              str(moe / "model.safetensors"), metadata={"format": "pt"})
    assert run(argv + ["--output", tmp_path / "out2"] + FAST) == 2
    err = capsys.readouterr().err
    assert "strata-train: error: --model %s: strata.torch.offload: weights=" % moe in err
    assert "shapes differ: model.layers.0.mlp.experts." in err and "Traceback" not in err
